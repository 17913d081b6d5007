"""relayrl/config/policy.py: the generation block's refit-verification and log-prob alarm settings."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from relayrl.config import GenerationConfig


def test_checks_are_on_by_default():
    gen = GenerationConfig()
    assert (gen.refit_verify, gen.logprob_error_alarm, gen.logprob_error_bound) == ("enforce", "enforce", 1.2)


def test_an_unquoted_yaml_off_means_off():
    raw = yaml.safe_load("refit_verify: off\nlogprob_error_alarm: off\n")
    assert raw["refit_verify"] is False  # YAML 1.1 reads it as a boolean
    gen = GenerationConfig.model_validate(raw)
    assert (gen.refit_verify, gen.logprob_error_alarm) == ("off", "off")


@pytest.mark.parametrize("bad", [{"refit_verify": True}, {"refit_verify": "warn"}, {"logprob_error_bound": 1.0}])
def test_other_values_are_refused(bad):
    with pytest.raises(ValidationError):
        GenerationConfig.model_validate(bad)
