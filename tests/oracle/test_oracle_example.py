"""The worked example of docs/oracle/example.rst runs, and the page shows what it prints."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "oracle" / "example_kernel.py"
PAGE = ROOT / "docs" / "oracle" / "example.rst"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("example_kernel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("policy", ["sink", "keydiff", "tova"])
def test_the_second_implementation_passes_the_golden_cases(example, policy):
    n, _ = example.check(policy, example.KERNELS[policy])
    assert n >= 3


def test_the_wrong_variant_is_caught_on_a_gqa_case(example):
    with pytest.raises(AssertionError, match=r"^scores differ \(tova case \d+ \[gqa"):
        example.check("tova", example.tova_kernel_wrong)
    message = example.first_failure("tova", example.tova_kernel_wrong, outputs=("kept",))
    assert re.search(r"head \d: candidate keeps position \d+ \(reference score [\d.]+\) instead of position \d+",
                     message)


def test_the_wrong_variant_agrees_without_gqa(example):
    # The bug (max instead of mean over the query group) is invisible with one query head
    # per KV head: why the golden cases include GQA layouts.
    from refkv.testing import assert_case, load_cases

    mha = [c for c in load_cases(example.GOLDEN, policy="tova", params={"all_heads": False}) if "mha" in c.flags]
    assert mha
    for case in mha:  # float64 inputs: the float32 kernel is checked on its kept tokens only
        assert_case(case, kept=example.tova_kernel_wrong(case)["kept"])


def _normalise(text: str) -> str:
    text = re.sub(r"\S*tmp\w+", "candidate", text).replace(str(ROOT / "tests" / "golden"), "tests/golden")
    return re.sub(r"; \d+\.\d\d s", "; 0.01 s", text)


def test_the_page_shows_what_the_example_prints(example, capsys):
    example.main()
    printed = _normalise(capsys.readouterr().out)
    page = PAGE.read_text()
    blocks = re.findall(r"\.\. begin-output: (\w+)\n\n\.\. code-block:: text\n\n(.*?)\n\n\.\. end-output", page, re.S)
    assert {name for name, _ in blocks} == {"passes", "kit", "kept", "cli"}
    for name, body in blocks:
        shown = "\n".join(line[3:] for line in body.splitlines())
        assert shown in printed, f"docs/oracle/example.rst block {name!r} is stale; rerun the example and paste"


def test_the_one_shot_workflow_of_the_docs_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("oneshot_cases", ROOT / "docs" / "oracle" / "oneshot_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = module.write_cases(tmp_path)
    assert module.check_kernel(path, module.refkv_as_kernel) == 2

    def wrong(case):  # SnapKV with a window of w + 1: a wrong kernel the cases must reject
        import refkv.policies as pol

        policy = pol.get("snapkv", window=case.params["window"] + 1)
        view = case.view()
        return {"scores": policy.score(view), "kept": policy.keep_indices(view)}

    with pytest.raises(AssertionError, match="scores differ"):
        module.check_kernel(path, wrong)
