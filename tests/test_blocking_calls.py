"""Every blocking call in relayrl/ has a deadline (issue 28 item 5): an AST scan that fails on a new unbounded one.

A wait without a deadline is how a run hangs silently (weight sync that never returns, a peer that never joins a
collective). Every module under relayrl/ is parsed (nothing is imported) and each call that can block forever
without a timeout argument is reported as `path:line in function: call`, unless the allowlist below names it with
the reason it cannot hang. What counts as unbounded:

- `ray.get(...)`, `ray.wait(...)`, `as_completed(...)`, `urlopen(...)`, `requests.<verb>(...)`,
  `subprocess.run/call/check_call/check_output(...)`, `Popen.communicate()` without `timeout=`;
- `select.select(r, w, x)` without its fourth (timeout) argument;
- `torch.distributed.init_process_group(...)` without `timeout=` (a group's timeout bounds its collectives);
- `x.join()`, `x.wait()`, `x.result()`, `x.get()` with no argument at all (a thread, process, event, condition,
  barrier, future or queue waited on forever; `str.join(parts)` and `dict.get(key)` always have one), `x.get(True)`
  or `x.get(block=True)` without a timeout, `x.wait_for(predicate)` and `x.acquire()` without a timeout;
- `x.recv*()` (a pipe or socket): its deadline lives elsewhere (a `poll(timeout)` first, a socket timeout), so
  every one must be named in the allowlist with where that is.

`with lock:` is not scanned: relayrl's locks guard in-memory bookkeeping only, and a lock held across another
blocking call is taken with `relayrl.utils.deadlines.held` (docs/design.md, "Deadlines", lists every site).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "relayrl"

#: `path::function::call` -> why it cannot hang (keep each reason to what makes it bounded).
ALLOWED: dict[str, str] = {
    # Ray: a result fetched after ray.wait reported its ref ready (the wait is the bounded one)
    "relayrl/distributed/ray_executor.py::_gather::ray.get(ref)": "ref is ready: ray.wait returned it",
    # Ray groups' async handles: `result()` is `wait()`, which gathers under cluster.call_timeout_s
    "relayrl/distributed/ray_executor.py::result::self.wait()": "wait() gathers under cluster.call_timeout_s",
    "relayrl/models/generation/distributed.py::_join_weight_group::handle.result()": "a group handle: call deadline",
    "relayrl/models/generation/distributed.py::_join_weight_group::joined.result()": "a group handle: call deadline",
    "relayrl/models/generation/distributed.py::_refit::handle.result()": "a group handle: call deadline",
    "relayrl/models/generation/distributed.py::_refit::receiving.result()": "a group handle: call deadline",
    # a ContextVar, not a queue
    "relayrl/models/fp8_kv.py::attention::_OBSERVER.get()": "ContextVar.get: never blocks",
    # the generation process's request loop: idle until the parent's next request; EOFError once the parent is gone
    "relayrl/models/generation/process_generation.py::_serve::conn.recv()": "child's idle loop: EOF ends it",
    # the parent's side: deadlines.recv polls with the call deadline first
    "relayrl/utils/deadlines.py::recv::conn.recv()": "after conn.poll(deadline)",
    # ZMQ refit: both sockets carry RCVTIMEO/SNDTIMEO = cluster.collective_timeout_s (zmq.Again -> DeadlineError)
    "relayrl/distributed/refit.py::await_ack::sock.recv()": "RCVTIMEO: collective deadline",
    "relayrl/distributed/refit.py::stream_weights_via_ipc_zmq::sock.recv()": "RCVTIMEO: collective deadline",
    "relayrl/distributed/refit.py::receive_weights_via_ipc_zmq::sock.recv_multipart(copy=False)": "RCVTIMEO",
    # a kernel build killed at its deadline: reaping a killed process returns at once
    "relayrl/models/fast/kernels.py::_compile::proc.communicate()": "after killpg(SIGKILL)",
    "relayrl/models/fast/kernels.py::_compile::proc.wait()": "after killpg(SIGKILL)",
    # gloo work of the weight-update group: the group's own timeout (cluster.collective_timeout_s) ends the wait
    "relayrl/distributed/refit_collective.py::_broadcast::self._pg.broadcast([tensor], _root(0)).wait()": "gloo group timeout",
    # the async producer idles until the trainer publishes the weights its next batch needs (bounded staleness):
    # that is the trainer's pace, whose own waits have deadlines; the thread is a daemon and never blocks an exit
    "relayrl/algorithms/async_rollouts.py::_run::self._cond.wait_for(lambda need=need: self._latest >= need or "
    "self._stopping)": "producer idle until the trainer's next weights",
}

_SUBPROCESS = {"run", "call", "check_call", "check_output"}
_REQUESTS = {"get", "post", "put", "patch", "delete", "head", "request"}
_NO_ARG_WAITS = {"join", "wait", "result", "get"}


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _unbounded(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
    has_timeout = _kw(call, "timeout") is not None
    nargs = len(call.args) + len(call.keywords)
    if name.startswith("recv") and owner != "deadlines":
        return True
    if owner == "ray" and name in ("get", "wait"):
        return not has_timeout
    if owner == "requests" and name in _REQUESTS or name in ("urlopen", "as_completed"):
        return not has_timeout
    if owner == "subprocess" and name in _SUBPROCESS or name == "communicate":
        return not has_timeout and not (name == "communicate" and len(call.args) >= 2)
    if owner == "select" and name == "select":
        return len(call.args) < 4 and not has_timeout
    if name == "init_process_group":
        return not has_timeout
    if name in _NO_ARG_WAITS and nargs == 0:
        return True
    if name == "get" and not has_timeout and len(call.args) <= 1:  # queue.get(True) / get(block=True)
        block = call.args[0] if call.args else _kw(call, "block")
        return isinstance(block, ast.Constant) and block.value is True and not isinstance(f.value, ast.Dict)
    if name == "wait_for":
        return not has_timeout and len(call.args) < 2
    if name == "acquire":
        blocking = call.args[0] if call.args else _kw(call, "blocking")
        non_blocking = isinstance(blocking, ast.Constant) and blocking.value is False
        return not has_timeout and len(call.args) < 2 and not non_blocking
    return False


def _calls(node: ast.AST, func: str) -> list[tuple[str, ast.Call]]:
    """(enclosing function, call) of every unbounded call under `node`, in source order."""
    out = []
    for child in ast.iter_child_nodes(node):
        inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
        if isinstance(child, ast.Call) and _unbounded(child):
            out.append((func, child))
        out += _calls(child, inner)
    return out


def unbounded_calls(root: Path, package: Path) -> list[tuple[str, int]]:
    """(`path::function::call`, line) of every unbounded blocking call under `package`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root).as_posix()

        found += [(f"{rel}::{func}::{ast.unparse(call)}", call.lineno) for func, call in _calls(tree, "<module>")]
    return found


@functools.cache
def _package_calls() -> list[tuple[str, int]]:
    return unbounded_calls(ROOT, PACKAGE)


def test_every_blocking_call_has_a_deadline() -> None:
    found = _package_calls()
    new = [
        f"{site.split('::')[0]}:{line} in {site.split('::')[1]}: {site.split('::', 2)[2]}"
        for site, line in found
        if site not in ALLOWED
    ]
    assert not new, (
        "blocking calls without a deadline (give each a timeout from the config through relayrl.utils.deadlines, or "
        "add it to ALLOWED in tests/test_blocking_calls.py with why it cannot hang):\n" + "\n".join(new)
    )


def test_the_allowlist_names_only_calls_that_exist() -> None:
    """A stale entry would silently allow the next call that happens to match it."""
    sites = {site for site, _ in _package_calls()}
    assert sorted(set(ALLOWED) - sites) == []


def test_the_scan_flags_each_kind_of_unbounded_wait(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        "import ray, select, subprocess, requests\n"
        "def f(q, t, ev, lock, cond, fut, conn, p, d):\n"
        "    ray.get(ref); ray.wait(refs); q.get(); q.get(True); t.join(); ev.wait(); lock.acquire()\n"
        "    cond.wait_for(pred); fut.result(); conn.recv(); p.communicate(); subprocess.run(['x'])\n"
        "    select.select([a], [], []); requests.get(url)\n"
        "def g(q, t, ev, lock, cond, fut, conn, p, d):\n"  # bounded, or not a wait at all
        "    ray.get(ref, timeout=1); q.get(timeout=1); q.get(False); t.join(1); ev.wait(1); lock.acquire(timeout=1)\n"
        "    lock.acquire(False); cond.wait_for(pred, 1); fut.result(1); p.communicate(timeout=1); d.get('k')\n"
        "    ', '.join(xs); select.select([a], [], [], 1); requests.get(url, timeout=1)\n"
    )
    found = [site.split("::", 2)[1:] for site, _ in unbounded_calls(tmp_path, package)]
    assert all(func == "f" for func, _ in found)
    assert [call for _, call in found] == [
        "ray.get(ref)", "ray.wait(refs)", "q.get()", "q.get(True)", "t.join()", "ev.wait()", "lock.acquire()",
        "cond.wait_for(pred)", "fut.result()", "conn.recv()", "p.communicate()", "subprocess.run(['x'])",
        "select.select([a], [], [])", "requests.get(url)",
    ]  # fmt: skip
