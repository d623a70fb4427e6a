"""`TuningConfig` (the plans' control-law constants hung off `ApexConfig`) and `apex_compile.envs`."""
import pytest

from apex_compile import envs
from apex_compile.config import ApexConfig, TuningConfig


def test_tuning_defaults_and_their_one_source():
    """The defaults are the measured optima; `ApexConfig` carries a fresh one per config."""
    tuning = TuningConfig()
    assert (tuning.job_share, tuning.auto_stagger_width, tuning.pipeline_reserve) == (0.95, 12, 0.3)
    first, second = ApexConfig(), ApexConfig()
    assert first.tuning == tuning and first.tuning is not second.tuning
    assert ApexConfig(tuning=TuningConfig(job_share=0.9)).tuning.job_share == 0.9


@pytest.mark.parametrize("fields,message", [
    (dict(job_share=0.0), "job_share"), (dict(job_share=1.6), "job_share"), (dict(job_share=True), "job_share"),
    (dict(auto_stagger_width=0), "auto_stagger_width"), (dict(auto_stagger_width=2.0), "auto_stagger_width"),
    (dict(pipeline_reserve=-0.1), "pipeline_reserve"), (dict(pipeline_reserve=None), "pipeline_reserve"),
])
def test_tuning_refuses_values_outside_its_ranges(fields, message):
    with pytest.raises(ValueError, match=f"TuningConfig.{message}"):
        TuningConfig(**fields)


def test_apex_config_takes_only_a_tuning_config():
    with pytest.raises(ValueError, match="ApexConfig.tuning"):
        ApexConfig(tuning={"job_share": 0.9})


def test_environment_variables_are_read_when_asked(monkeypatch, tmp_path):
    """Each variable is read on access (set after import, it counts) and has its documented default."""
    monkeypatch.delenv("APEX_COMPILE_CACHE_DIR", raising=False)
    monkeypatch.delenv("APEX_COMPILE_PROFILE_REFRESH", raising=False)
    assert envs.APEX_COMPILE_CACHE_DIR.endswith(".cache/apex_compile") and not envs.APEX_COMPILE_PROFILE_REFRESH
    monkeypatch.setenv("APEX_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("APEX_COMPILE_PROFILE_REFRESH", "1")
    assert envs.APEX_COMPILE_CACHE_DIR == str(tmp_path) and envs.APEX_COMPILE_PROFILE_REFRESH
    with pytest.raises(AttributeError):
        envs.APEX_COMPILE_NOT_A_VARIABLE
