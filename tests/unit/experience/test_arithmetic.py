"""The arithmetic task: problem generation, the fixed held-out split, and the math-verify answer format."""

from __future__ import annotations

import pytest
from math_verify import parse, verify

from relayrl.experience.arithmetic import (
    DEFAULT_NUM_VAL,
    HELD_OUT_SEED,
    ArithmeticProblem,
    all_problems,
    format_answer,
    is_correct,
    split_problems,
)


def test_all_problems_default_grid() -> None:
    problems = all_problems()
    assert len(problems) == 2 * 90 * 90
    assert problems[0] == ArithmeticProblem("10+10=", "20")
    assert ArithmeticProblem("37+45=", "82") in problems
    assert ArithmeticProblem("12-45=", "-33") in problems
    assert problems[-1] == ArithmeticProblem("99-99=", "0")
    assert len(set(problems)) == len(problems)
    assert all_problems() == problems  # deterministic order


def test_all_problems_options() -> None:
    problems = all_problems(1, 3, operations=("*",))
    assert [p.problem for p in problems][:4] == ["1*1=", "1*2=", "1*3=", "2*1="]
    assert problems[-1].answer == "9"
    assert all(int(eval(p.problem[:-1])) == int(p.answer) for p in all_problems(0, 12, ("+", "-", "*")))  # noqa: S307


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_operand": 5, "max_operand": 4}, "min_operand"),
        ({"operations": ()}, "operations"),
        ({"operations": ("/",)}, "unsupported"),
        ({"operations": ("+", "+")}, "duplicates"),
    ],
)
def test_all_problems_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        all_problems(**kwargs)


def test_split_is_fixed_disjoint_and_complete() -> None:
    problems = all_problems()
    train, val = split_problems(problems, DEFAULT_NUM_VAL)
    assert len(val) == DEFAULT_NUM_VAL and len(train) == len(problems) - DEFAULT_NUM_VAL
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(problems)
    assert split_problems(problems, DEFAULT_NUM_VAL) == (train, val)
    assert split_problems(problems, DEFAULT_NUM_VAL, seed=HELD_OUT_SEED) == (train, val)
    assert split_problems(problems, DEFAULT_NUM_VAL, seed=HELD_OUT_SEED + 1)[1] != val
    # Both halves keep the input order, so the split does not depend on how callers iterate.
    train_set, val_set = set(train), set(val)
    assert train == [p for p in problems if p in train_set]
    assert val == [p for p in problems if p in val_set]


@pytest.mark.parametrize("num_val", [0, -1, 10, 11])
def test_split_rejects_bad_num_val(num_val: int) -> None:
    problems = all_problems(1, 2, ("+", "-"))[:10]
    with pytest.raises(ValueError, match="num_val"):
        split_problems(problems, num_val)


def test_format_answer() -> None:
    assert format_answer("82") == r"\boxed{82}"
    assert format_answer("-33") == r"\boxed{-33}"


def test_math_verify_accepts_the_format() -> None:
    assert verify(parse(r"\boxed{82}"), parse(format_answer("82")))
    assert not verify(parse(r"\boxed{82}"), parse(format_answer("83")))
    assert verify(parse(r"\boxed{-33}"), parse(format_answer("-33")))
    assert not verify(parse(r"\boxed{-33}"), parse(format_answer("33")))


def test_is_correct() -> None:
    assert is_correct(r"\boxed{82}", "82")
    assert is_correct(r"\boxed{-33}", "-33")
    assert not is_correct(r"\boxed{-33}", "33")
    assert not is_correct(r"\boxed{83}", "82")
    assert not is_correct("", "82")
    assert not is_correct(r"\boxed{", "82")
