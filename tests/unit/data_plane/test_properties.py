"""Property tests: random puts, gets, clears and meta transforms against a plain dict model never lose,
duplicate or corrupt a row."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import FieldNotWrittenError, KVBatchMeta, MissingKeysError
from relayrl.data_plane.memory import ColumnarStore
from relayrl.data_plane.preshard import shard_meta_for_dp

POOL = [f"k{i}" for i in range(10)]
key_lists = st.lists(st.sampled_from(POOL), min_size=1, max_size=6, unique=True)


class StoreVsModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = ColumnarStore(storage_capacity=len(POOL))
        self.store.register_partition("p", ["tok", "row"], len(POOL), ["t"])
        self.model: dict[str, dict[str, torch.Tensor]] = {}  # key -> field -> that sample's tensor
        self.order: list[str] = []  # first-put order of live keys

    def _live(self) -> list[str]:
        return [k for k in self.order if k in self.model]

    @rule(keys=key_lists, seed=st.integers(0, 10_000), jagged=st.booleans())
    def put(self, keys: list[str], seed: int, jagged: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        if jagged:
            lens = torch.randint(0, 5, (len(keys),), generator=g)
            col = Column(torch.randn(int(lens.sum()), 2, generator=g), lens)
            self.store.put_samples(keys, "p", {"tok": col})
            rows = [col.row(i).clone() for i in range(len(keys))]
            name = "tok"
        else:
            vals = torch.randint(-100, 100, (len(keys), 3), generator=g)
            self.store.put_samples(keys, "p", {"row": vals})
            rows = [vals[i].clone() for i in range(len(keys))]
            name = "row"
        for k, r in zip(keys, rows):
            if k not in self.model:
                self.model[k] = {}
                self.order = [o for o in self.order if o != k] + [k]
            self.model[k][name] = r

    @rule(keys=st.lists(st.sampled_from(POOL), min_size=0, max_size=8), field=st.sampled_from(["tok", "row"]))
    def get(self, keys: list[str], field: str) -> None:
        missing = [k for k in keys if k not in self.model]
        unwritten = [k for k in keys if k in self.model and field not in self.model[k]]
        ever_written = any(field in v for v in self.model.values())
        try:
            got = self.store.get_samples(keys, "p", [field])[field]
        except MissingKeysError as e:
            assert missing and e.missing == missing
            return
        except FieldNotWrittenError as e:
            assert not missing and (unwritten or not ever_written)
            assert e.missing == (unwritten if unwritten else keys)
            return
        assert not missing and not unwritten
        assert got.num_rows == len(keys)
        for i, k in enumerate(keys):
            assert torch.equal(got.row(i), self.model[k][field])

    @rule(keys=st.one_of(st.none(), st.lists(st.sampled_from(POOL), max_size=5)))
    def clear(self, keys: list[str] | None) -> None:
        targets = list(self.model) if keys is None else [k for k in dict.fromkeys(keys) if k in self.model]
        assert self.store.clear_samples(keys, "p") == len(targets)
        for k in targets:
            del self.model[k]

    @precondition(lambda self: any("tok" in v for v in self.model.values()))
    @rule(dp=st.integers(1, 4), picks=st.lists(st.integers(0, 100), min_size=1, max_size=8), cut=st.integers(0, 8))
    def transform_and_shard(self, dp: int, picks: list[int], cut: int) -> None:
        live = [k for k in self._live() if "tok" in self.model[k]]
        lens = [self.model[k]["tok"].shape[0] for k in live]
        meta = KVBatchMeta("p", live, ["tok"], lens, tags=[{"k": k} for k in live])
        chosen = meta.subset([p % meta.size for p in picks])
        meta2 = chosen.slice(0, cut).concat(chosen.slice(cut, chosen.size))
        assert meta2.keys == chosen.keys
        dropped = meta2.drop(range(0, meta2.size, 3))
        for m in [meta2] + ([dropped] if dropped is not None else []):
            shards = shard_meta_for_dp(m, dp)
            assert Counter(k for s in shards for k in s.keys) == Counter(m.keys)
            assert max(s.size for s in shards) - min(s.size for s in shards) <= 1
            for s in shards:
                assert [t["k"] for t in s.tags or []] == s.keys
                if s.size:
                    got = self.store.get_data(s)["tok"]
                    assert got.lengths is not None and got.lengths.tolist() == s.sequence_lengths
                    for i, k in enumerate(s.keys):
                        assert torch.equal(got.row(i), self.model[k]["tok"])

    @invariant()
    def same_keys_in_same_order(self) -> None:
        assert self.store.keys("p") == self._live()
        assert self.store.num_samples_held() == len(self.model)


StoreVsModel.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStoreVsModel = StoreVsModel.TestCase
