"""The suite's own rules (tests/conftest.py): on CI a skip of any kind fails the run and names its
reason, and every test that uses the Ray cluster carries the `ray` marker. Run on a throwaway suite."""

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


COLLECTION_SKIPS = {
    "test_importorskip": 'import pytest\n\npytest.importorskip("no_such_package_mdc")\n\ndef test_a():\n    pass\n',
    "test_module_skip": (
        'import pytest\n\npytest.skip("libcairo2 not installed", allow_module_level=True)\n\ndef test_b():\n    pass\n'
    ),
}


@pytest.mark.parametrize("ci", ["true", None])
def test_a_module_skipped_while_collected_fails_the_run_only_on_ci(pytester, monkeypatch, ci):
    """`pytest.importorskip` and a module-level `pytest.skip` skip before any test exists, so the
    per-test hook never sees them."""
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makeconftest(CONFTEST.replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(**COLLECTION_SKIPS, test_plain="def test_plain():\n    pass\n")
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    if ci:
        result.assert_outcomes(errors=2)  # collection errors: pytest stops before running any test
        result.stdout.fnmatch_lines_random(
            [
                "*test_importorskip.py was skipped on CI*could not import 'no_such_package_mdc'*",
                "*test_module_skip.py was skipped on CI*libcairo2 not installed*",
            ]
        )
        assert result.ret != 0
    else:
        result.assert_outcomes(passed=1, skipped=2)
        assert result.ret == 0
