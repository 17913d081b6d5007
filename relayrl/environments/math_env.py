r"""Math environment: reward 1.0 when the last `\boxed{...}` of the response equals the ground truth, else 0.0.

Equality is decided by math-verify (`parse` + `verify`, the gold wrapped as `\boxed{gt}`), so `\frac{1}{2}` and
`0.5` agree. Two things keep it fast enough to sit inside every rollout: a pair of plain short integers (the
arithmetic task's answers) is compared exactly without sympy, which is what math-verify would answer (a test checks
this), and verdicts are cached.

Everything else runs in a child process. math-verify's own time-outs use `signal.alarm`, which works only on the
main thread and cannot interrupt a long C-level computation (sympy evaluating `9^{9^{9^{9}}}` holds the GIL), so a
thread or an alarm can still hang the run. The child is killed when one verification exceeds `timeout_s` and a
fresh one is started on demand. A verification that raises or times out scores 0 and is counted (`last_metrics`,
and `num_verify_errors` / `num_verify_timeouts` in `global_post_process_and_metrics`).

A batch has a budget too (`batch_timeout_s`): once that much verification time is spent on one batch, its answers
not yet verified score 0 without being tried, one warning line gives their count, and `num_verify_over_budget`
counts them; so a batch of answers that each take just under `timeout_s` cannot stall a step for hours.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from relayrl.config import MathEnvConfig
from relayrl.environments.dapo_verify import dapo_score
from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog

log = logging.getLogger(__name__)

# Integers this short compare exactly in sympy; longer ones math-verify compares at 15 significant digits.
_SHORT_INT = re.compile(r"^-?\d{1,12}$")
_CACHE_SIZE = 65536
_STARTUP_TIMEOUT_S = 120.0  # importing sympy in a fresh interpreter on a busy machine
_COUNTER = {"error": "num_verify_errors", "timeout": "num_verify_timeouts", "over_budget": "num_verify_over_budget"}


def extract_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` in `text` (nested braces balanced), or None when there is none."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len("\\boxed{") : i - 1]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: fall back to an earlier, complete one
    return None


def verify_answer(ground_truth: str, answer: str) -> float:
    """math-verify's verdict for one (gold, boxed content) pair, in this process and without a time limit."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = parse(f"\\boxed{{{ground_truth}}}", [LatexExtractionConfig()], parsing_timeout=None, raise_on_error=True)
    pred_config = [ExprExtractionConfig(), LatexExtractionConfig()]
    pred = parse(f"\\boxed{{{answer}}}", pred_config, parsing_timeout=None, raise_on_error=True)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None, raise_on_error=True) else 0.0


# The child runs this loop with `verify_answer`'s source prepended: a bare interpreter that imports only
# math-verify starts in about a second, where one importing relayrl (and so torch) would take several.
_WORKER_LOOP = """
import json, logging, sys
out, sys.stdout = sys.stdout, sys.stderr  # stray prints cannot corrupt the protocol stream
logging.getLogger("math_verify").setLevel(logging.ERROR)  # mutes its "timeout is disabled" notice
verify_answer("1/2", "\\\\frac{1}{2}")  # warm the lazy grammar and sympy imports before taking rows
out.write("@@ready\\n"); out.flush()
for line in sys.stdin:
    gold, pred = json.loads(line)
    try:
        reply = ["ok", verify_answer(gold, pred)]
    except Exception:
        reply = ["error", 0.0]
    out.write("@@" + json.dumps(reply) + "\\n"); out.flush()
"""


class _Verifier:
    """A lazily started child interpreter verifying one pair at a time; killed when a pair overruns."""

    def __init__(self, source: str) -> None:
        self._source = source
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._lock = threading.Lock()  # one conversation with the child at a time

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self._source], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        self._buffer = b""
        if self._read_reply(_STARTUP_TIMEOUT_S) != "ready":
            self._close()
            raise RuntimeError("math-verify worker process did not start")

    def _read_reply(self, timeout_s: float) -> str | None:
        """The next `@@` line from the child, or None on time-out or end of stream."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                if line.startswith(b"@@"):
                    return line[2:].decode()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk

    def run(
        self, pairs: list[tuple[str, str]], timeout_s: float, batch_timeout_s: float = float("inf")
    ) -> list[tuple[float, str]]:
        """(score, outcome) per pair, outcome one of ok / error / timeout / over_budget (not tried: the batch had
        spent `batch_timeout_s` verifying; the worker's start-up does not count)."""
        with self._lock:
            return self._run(pairs, timeout_s, batch_timeout_s)

    def _run(self, pairs: list[tuple[str, str]], timeout_s: float, batch_timeout_s: float) -> list[tuple[float, str]]:
        out: list[tuple[float, str]] = []
        spent = 0.0
        for gold, pred in pairs:
            left = batch_timeout_s - spent
            if left <= 0:
                return self._over_budget(out, len(pairs), batch_timeout_s)
            if self._proc is None:
                try:
                    self._start()
                except (OSError, RuntimeError) as e:
                    log.warning("math-verify worker failed to start (%s); scoring %d rows 0", e, len(pairs) - len(out))
                    return out + [(0.0, "error")] * (len(pairs) - len(out))
            assert self._proc is not None and self._proc.stdin is not None
            cut = left < timeout_s  # this answer's wait ends with the batch budget, not its own time-out
            started = time.monotonic()
            try:
                payload = memoryview((json.dumps([gold, pred]) + "\n").encode())
                while payload:  # unbuffered pipe writes may be partial
                    payload = payload[self._proc.stdin.write(payload) or 0 :]
                reply = self._read_reply(min(timeout_s, left))
            except OSError:  # broken pipe: the child died
                reply = None
            spent += time.monotonic() - started
            if reply is None:
                timed_out = self._proc.poll() is None
                self._close()  # the next pair goes to a fresh process
                if timed_out and cut:  # this answer and the rest: over budget
                    return self._over_budget(out, len(pairs), batch_timeout_s)
                if timed_out:
                    log.warning("math-verify took over %.1fs; scoring 0", timeout_s)
                out.append((0.0, "timeout" if timed_out else "error"))
                continue
            outcome, score = json.loads(reply)
            out.append((float(score), outcome))
        return out

    @staticmethod
    def _over_budget(out: list[tuple[float, str]], n: int, batch_timeout_s: float) -> list[tuple[float, str]]:
        rest = n - len(out)
        log.warning(
            "math-verify spent the batch budget of %.1fs; scoring %d unverified answers 0", batch_timeout_s, rest
        )
        return out + [(0.0, "over_budget")] * rest

    def close(self) -> None:
        """Kill the child (idempotent); the next pair starts a new one."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(5)
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    stream.close()
        self._proc = None

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # interpreter shutdown: the child exits on its own when stdin closes
            pass


_VERIFIERS: dict[tuple[int, str], _Verifier] = {}
_VERIFIERS_LOCK = threading.Lock()


def _shared_verifier() -> _Verifier:
    """This process's verifier child, shared by its math environments (train and validation, and every run of a
    process that trains several times: each new child costs a second of CPU importing sympy). Keyed by pid, so a
    forked process never talks to its parent's child, and by the worker's source."""
    key = (os.getpid(), inspect.getsource(verify_answer) + _WORKER_LOOP)
    with _VERIFIERS_LOCK:
        if key not in _VERIFIERS:
            _VERIFIERS[key] = _Verifier(key[1])
        return _VERIFIERS[key]


class MathEnvironment(EnvironmentInterface):
    """Single-turn math grader: every row terminates after one scored answer."""

    def __init__(self, cfg: MathEnvConfig | None = None) -> None:
        self.cfg = cfg or MathEnvConfig()
        self.last_metrics: dict[str, int] = {}
        # Counts since the last `global_post_process_and_metrics`, which reports and resets them.
        self._pending = {"num_verify_errors": 0, "num_verify_timeouts": 0, "num_verify_over_budget": 0}
        self._verifier = _shared_verifier()
        self._cache: OrderedDict[tuple[str, str], float] = OrderedDict()  # (gold, answer) -> verdict, LRU

    # ------------------------------------------------------------------ scoring
    def score_batch(
        self, responses: list[str], ground_truths: list[str]
    ) -> tuple[list[float], list[str | None], dict[str, int]]:
        """Rewards, extracted boxed answers, and failure counts for parallel lists of responses and answers."""
        if self.cfg.math_verify_impl == "dapo_math_verify":  # string work only: inline, nothing to time out
            scored = [dapo_score(r, t) for r, t in zip(responses, ground_truths)]
            zero = {"num_verify_errors": 0, "num_verify_timeouts": 0, "num_verify_over_budget": 0}
            return [score for score, _ in scored], [answer for _, answer in scored], zero
        answers = [extract_boxed(r) for r in responses]
        rewards = [0.0] * len(responses)
        slow: dict[tuple[str, str], list[int]] = {}  # distinct pairs needing math-verify -> rows
        for i, (answer, truth) in enumerate(zip(answers, ground_truths)):
            if answer is None:
                continue
            key = (truth.strip(), answer.strip())
            if _SHORT_INT.match(key[0]) and _SHORT_INT.match(key[1]):
                rewards[i] = float(int(key[0]) == int(key[1]))
            elif key in self._cache:
                self._cache.move_to_end(key)
                rewards[i] = self._cache[key]
            else:
                slow.setdefault(key, []).append(i)
        counts = {"num_verify_errors": 0, "num_verify_timeouts": 0, "num_verify_over_budget": 0}
        if slow:
            verdicts = self._verifier.run(list(slow), self.cfg.timeout_s, self.cfg.batch_timeout_s)
            for key, (score, outcome) in zip(slow, verdicts):
                for i in slow[key]:
                    rewards[i] = score
                if outcome == "ok":
                    self._cache[key] = score
                    if len(self._cache) > _CACHE_SIZE:
                        self._cache.popitem(last=False)
                else:
                    counts[_COUNTER[outcome]] += len(slow[key])
        return rewards, answers, counts

    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        """Score the concatenated assistant text of each row against `metadata[i]["ground_truth"]`."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"math env got {len(message_log_batch)} message logs but {len(metadata)} metadata rows")
        truths = []
        for i, meta in enumerate(metadata):
            if not meta or "ground_truth" not in meta:
                raise ValueError(f"math env row {i}: metadata has no 'ground_truth'")
            truths.append(str(meta["ground_truth"]))
        responses = [
            "".join(str(m.get("content") or "") for m in log if m.get("role") == "assistant")
            for log in message_log_batch
        ]
        rewards, answers, counts = self.score_batch(responses, truths)
        self.last_metrics = counts
        for k, v in counts.items():
            self._pending[k] += v
        observations = [
            {"role": "environment", "content": "Environment: correct" if r else "Environment: incorrect"}
            for r in rewards
        ]
        n = len(rewards)
        return EnvironmentReturn(
            observations=observations,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),  # [B]
            terminateds=torch.ones(n, dtype=torch.bool),  # [B]
            answers=answers,
        )

    def shutdown(self) -> None:
        """Nothing to stop: the verifier child is the process's (`_shared_verifier`) and ends with it, its stdin
        closing; a run that ends leaves it for the next run of the process."""

    # ------------------------------------------------------------------ batch metrics
    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """Accuracy-style metrics over a finished rollout batch (rewards of rows that did not end properly are 0).

        Reads `total_reward` (or `rewards`) [B], `truncated` [B] (or `is_end`), `length` [B] prompt tokens,
        `message_log` and, to group samples of one prompt for pass@k, `idx` [B].
        """
        rewards = batch["rewards"] if "rewards" in batch else batch["total_reward"]
        rewards = torch.as_tensor(rewards, dtype=torch.float32)  # [B]
        n = rewards.shape[0]
        if "is_end" in batch:
            is_end = torch.as_tensor(batch["is_end"], dtype=torch.bool)
        elif "truncated" in batch:
            is_end = ~torch.as_tensor(batch["truncated"], dtype=torch.bool)
        else:
            is_end = torch.ones(n, dtype=torch.bool)
        rewards = rewards * is_end.float()
        batch["rewards"] = rewards

        gen_lengths = torch.tensor(
            [
                sum(len(m.get("token_ids", ())) for m in log if m.get("role") == "assistant")
                for log in batch["message_log"]
            ],
            dtype=torch.float32,
        )  # [B]
        prompt_lengths = torch.as_tensor(batch["length"], dtype=torch.float32) if "length" in batch else None
        correct = rewards > 0
        groups = [int(i) for i in batch["idx"]] if "idx" in batch else list(range(n))
        solved: dict[int, bool] = {}
        for g, ok in zip(groups, correct.tolist()):
            solved[g] = solved.get(g, False) or ok
        metrics: dict[str, Any] = {
            "accuracy": rewards.mean().item() if n else 0.0,
            "pass@samples_per_prompt": sum(solved.values()) / len(solved) if solved else 0.0,
            "fraction_of_samples_properly_ended": is_end.float().mean().item() if n else 0.0,
            "num_problems_in_batch": n,
            "generation_lengths": gen_lengths.mean().item() if n else 0.0,
            "prompt_lengths": prompt_lengths.mean().item() if prompt_lengths is not None and n else 0.0,
            "correct_solution_generation_lengths": gen_lengths[correct].mean().item() if correct.any() else 0.0,
            **self._pending,
        }
        self._pending = {k: 0 for k in self._pending}
        return batch, metrics
