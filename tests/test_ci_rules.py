"""The suite's own rules (tests/conftest.py): on CI a skip fails the run and names its reason, and
every test that uses the Ray cluster carries the `ray` marker. Run on a throwaway suite."""

from pathlib import Path

import pytest

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()

SUITE = """
import pytest

@pytest.fixture
def ray_cluster():
    yield

@pytest.mark.skipif(True, reason="envsubst (gettext-base) not installed")
def test_needs_envsubst():
    pass

def test_uses_ray(ray_cluster):
    pass

def test_plain():
    pass
"""


@pytest.fixture
def throwaway(pytester):
    pytester.makeconftest(CONFTEST.replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(test_throwaway=SUITE)
    return pytester


@pytest.mark.parametrize("ci", ["true", None])
def test_a_skip_fails_the_run_only_on_ci(throwaway, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    result = throwaway.runpytest("-rs", "-p", "no:cacheprovider")
    if ci:
        result.assert_outcomes(passed=2, errors=1)
        result.stdout.fnmatch_lines(["*test_needs_envsubst was skipped on CI*envsubst (gettext-base) not installed*"])
        assert result.ret != 0
    else:
        result.assert_outcomes(passed=2, skipped=1)
        result.stdout.fnmatch_lines(["SKIPPED*envsubst (gettext-base) not installed"])
        assert result.ret == 0


def test_tests_using_the_ray_cluster_are_marked_ray(throwaway, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = throwaway.runpytest("-m", "not ray", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1, deselected=1)
