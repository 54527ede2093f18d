"""audits.domain: a kernel's declared domain — parsed and checked (errors name the key, the value,
where it came from and what is accepted), narrowed by a file, and each axis's refusal."""

import dataclasses
import itertools
import json

import pytest

from audits.cases import Case, case_from_dict, release_suite
from audits.domain import Domain, DomainError, domain_of, release_within

#: the issue's example: a Triton-tutorial-like kernel
TRITON = {
    "dtypes": ["float16"], "head_dims": [[64, 64], [128, 128]], "seqlen_multiple": 128, "equal_seqlens": True,
    "max_seqlen": 8192, "causal": True, "local": False, "softcap": False, "sink": False, "gqa": True,
    "layouts": ["contiguous", "strided"], "backward": False, "deterministic": False,
}  # fmt: skip


def test_the_dict_form_and_its_round_trip():
    d = Domain.from_dict(TRITON, where="k.fa4_audit_domain")
    assert d.dtypes == ("float16",) and d.head_dims == ((64, 64), (128, 128)) and d.seqlen_multiple == 128
    assert d.as_dict() == {**TRITON, "min_seqlen": 1}
    assert Domain.from_dict({}, where="x") == Domain()  # every key optional: no restriction


@pytest.mark.parametrize(
    "decl,message",
    [
        ({"dtype": ["float16"]}, "unknown domain key(s) dtype; accepted: dtypes, head_dims,"),
        ({"dtypes": ["float32"]}, "'dtypes' = ['float32']: expected a non-empty list of bfloat16, float16,"),
        ({"causal": "yes"}, "'causal' = 'yes': expected true or false"),
        ({"seqlen_multiple": 0}, "'seqlen_multiple' = 0: expected a positive integer"),
        ({"head_dims": [64, 128]}, "'head_dims' = [64, 128]: expected a non-empty list of [d, dv] pairs"),
        ({"layouts": ["packed"]}, "expected a non-empty list of contiguous, strided, packed_qkv"),
        (["float16"], "a domain is a dict of keys dtypes, head_dims"),
    ],
)
def test_bad_declarations_name_the_key_the_value_and_what_is_accepted(decl, message):
    with pytest.raises(DomainError, match="^where: .*") as exc:
        Domain.from_dict(decl, where="where")
    assert message in str(exc.value)


def test_a_toml_file_declares_and_narrows(tmp_path):
    f = tmp_path / "domain.toml"
    f.write_text('dtypes = ["float16", "bfloat16"]\nseqlen_multiple = 64\nmax_seqlen = 4096\nsoftcap = false\n')
    narrowed = Domain.from_dict(TRITON, where="k").narrow(Domain.from_toml(f))
    assert narrowed.dtypes == ("float16",) and narrowed.seqlen_multiple == 128 and narrowed.max_seqlen == 4096
    assert narrowed.equal_seqlens and not narrowed.softcap and narrowed.causal
    with pytest.raises(DomainError, match="no such domain file"):
        Domain.from_toml(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("dtypes = [")
    with pytest.raises(DomainError, match="bad.toml: not valid TOML"):
        Domain.from_toml(tmp_path / "bad.toml")


def test_each_axis_refuses_with_its_reason():
    d = Domain.from_dict(TRITON, where="k")
    inside = Case("float16", 64, 64, 1, 4, 2, 256, 256, causal=True)
    assert d.refusal(inside) is None
    for change, why in [
        ({"dtype": "bfloat16"}, "dtype bfloat16 not in"),
        ({"d": 96, "dv": 96}, "head dims (96, 96) not in"),
        ({"seqlen_q": 200, "seqlen_k": 200}, "not multiples of 128"),
        ({"seqlen_k": 384}, "seqlen_q != seqlen_k"),
        ({"seqlen_q": 16384, "seqlen_k": 16384}, "a seqlen above 8192"),
        ({"causal": False, "window": (64, 0)}, "local windows unsupported"),
        ({"softcap": 15.0}, "softcap unsupported"),
        ({"sink": True}, "learnable sink unsupported"),
        ({"layout": "packed_qkv"}, "layout packed_qkv not in"),
    ]:
        assert why in d.refusal(dataclasses.replace(inside, **change)), change
    assert "GQA/MQA" in Domain(gqa=False).refusal(inside)
    assert "below 512" in Domain(min_seqlen=512).refusal(inside)


def test_domain_of_a_kernel():
    def k(q, k, v, **kw):
        return q

    assert domain_of(k) == Domain()
    k.fa4_audit_domain = TRITON
    assert domain_of(k).seqlen_multiple == 128
    k.fa4_audit_domain = {"causal": 1}
    with pytest.raises(DomainError, match=r"test_domain_of_a_kernel.<locals>.k.fa4_audit_domain: domain key 'causal'"):
        domain_of(k)


def test_release_today_has_no_case_inside_the_triton_domain():
    """The gap issue 14 closes: the release suite, built without regard to a kernel's domain, has
    no case such a kernel supports (the suite generator must build within the domain instead)."""
    d = Domain.from_dict(TRITON, where="k")
    assert sum(d.refusal(c) is None for c in release_suite()) == 0


def test_release_is_built_within_the_domain_not_filtered():
    """The issue's kernel: every case inside its domain, every pair of the supported axis values
    covered (per family), every family placed but nan_inf_masked (no windows, equal lengths: no
    key can be unseen), listed with the reason; lengths include one block, odd multiples and
    long ones.  The unrestricted domain gives release itself."""
    d = Domain.from_dict(TRITON, where="k")
    r = release_within(d)
    assert r["cases"] and all(d.refusal(c) is None for c in r["cases"])
    assert set(r["not_applicable"]) == {"nan_inf_masked"}
    assert "needs keys no query sees" in r["not_applicable"]["nan_inf_masked"]
    from audits.inputs import FAMILIES

    assert {c.family for c in r["cases"]} == set(FAMILIES) - {"nan_inf_masked"}
    lengths = {c.seqlen_q for c in r["cases"]}
    assert {128, 384, 640, 8192} <= lengths and max(lengths) <= 8192
    normal = [c for c in r["cases"] if c.family == "normal"]
    value = {
        "dtype": lambda c: c.dtype, "d": lambda c: (c.d, c.dv), "heads": lambda c: (c.heads_q, c.heads_kv),
        "seqlens": lambda c: (c.seqlen_q, c.seqlen_k), "layout": lambda c: c.layout,
        "mask": lambda c: "causal" if c.causal else "none", "softcap": lambda c: c.softcap, "sink": lambda c: c.sink,
    }  # fmt: skip
    axes = r["axes"]
    for a, b in itertools.combinations(axes, 2):
        seen = {(value[a](c), value[b](c)) for c in normal}
        assert seen == set(itertools.product(axes[a], axes[b])), (a, b)
    assert release_within(Domain())["cases"] == release_suite()


def test_a_restricted_kernel_gets_smoke_built_in_its_domain(tmp_path, capsys):
    """examples/restricted_kernel.py declares fp16, equal lengths in multiples of 128, d 64/128:
    ``run --suite smoke`` builds every case inside that (none skipped), says which family does
    not apply and why, and the report states the domain; ``--domain FILE`` narrows it further,
    and a bad file is a usage error."""
    from audits import cli

    kern = "examples/restricted_kernel.py:attention"
    out = tmp_path / "r"
    assert cli.main(["run", "--kernel", kern, "--suite", "smoke", "--out", str(out), "--quiet"]) == 0
    rep = json.loads((out / "report.json").read_text())
    declared = Domain.from_dict(rep["domain"]["domain"], where="report")
    assert rep["summary"]["verdicts"]["pass"] == rep["summary"]["cases"] == len(rep["cases"]) > 15
    assert all(declared.refusal(case_from_dict(c["config"])) is None for c in rep["cases"])
    assert set(rep["domain"]["not_applicable"]) == {"nan_inf_masked"}
    assert "family nan_inf_masked not applicable in the kernels' domain" in capsys.readouterr().err
    narrow = tmp_path / "d64.toml"
    narrow.write_text("head_dims = [[64, 64]]\ncausal = false\n")
    argv = ["run", "--kernel", kern, "--suite", "smoke", "--domain", str(narrow), "--out", str(tmp_path / "n")]
    assert cli.main([*argv, "--quiet"]) == 0
    cases = json.loads((tmp_path / "n" / "report.json").read_text())["cases"]
    assert {(c["config"]["d"], c["config"]["causal"]) for c in cases} == {(64, False)}
    narrow.write_text("head_dim = [[64, 64]]\n")
    assert cli.main([*argv, "--quiet", "--overwrite"]) == 2
    assert "unknown domain key(s) head_dim; accepted: dtypes" in capsys.readouterr().err


def test_a_domain_built_suite_runs_with_jobs_and_resumes(tmp_path):
    """``--jobs`` children get the parent's domain-built cases (through the case file) and
    ``--resume`` continues them: the report holds exactly the cases the domain built."""
    from audits import cli
    from audits.domain import smoke_within

    kern = "examples/restricted_kernel.py:attention"
    narrow = tmp_path / "d.toml"
    narrow.write_text("head_dims = [[64, 64]]\n")
    argv = ["run", "--kernel", kern, "--suite", "smoke", "--domain", str(narrow), "--jobs", "2", "--quiet"]
    out = tmp_path / "j"
    assert cli.main([*argv, "--out", str(out)]) == 0
    want = {c.name for c in smoke_within(Domain.from_dict(TRITON, where="k").narrow(Domain.from_toml(narrow)))["cases"]}
    first = {c["case"]: c["seconds"] for c in json.loads((out / "report.json").read_text())["cases"]}
    assert set(first) == want
    assert cli.main([*argv, "--out", str(out), "--resume"]) == 0
    again = {c["case"]: c["seconds"] for c in json.loads((out / "report.json").read_text())["cases"]}
    assert again == first  # the same cases, none redone
