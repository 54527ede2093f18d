"""audits.suites.domain: a kernel's declared domain — parsed and checked (errors name the key, the value,
where it came from and what is accepted), narrowed by a file, and each axis's refusal."""

import dataclasses
import itertools
import json

import pytest

from audits.suites.cases import MOD_KINDS, Case, case_from_dict, mods_suite, release_suite, release_within
from audits.suites.domain import Domain, DomainError, domain_of

#: the issue's example: a Triton-tutorial-like kernel
TRITON = {
    "dtypes": ["float16"], "head_dims": [[64, 64], [128, 128]], "seqlen_multiple": 128, "equal_seqlens": True,
    "max_seqlen": 8192, "causal": True, "local": False, "softcap": False, "sink": False, "gqa": True,
    "layouts": ["contiguous", "strided"], "backward": False, "deterministic": False,
}  # fmt: skip


def test_the_dict_form_and_its_round_trip():
    d = Domain.from_dict(TRITON, where="k.fa4_audit_domain")
    assert d.dtypes == ("float16",) and d.head_dim_pairs() == ((64, 64), (128, 128))
    assert d.seqlen_q_multiple == d.seqlen_k_multiple == 128  # the shorthand sets both
    written = {k: v for k, v in TRITON.items() if k != "seqlen_multiple"}
    assert d.as_dict() == {**written, "seqlen_q_multiple": 128, "seqlen_k_multiple": 128, "min_seqlen": 1}
    assert (
        Domain.from_dict(d.as_dict(), where="report") == d
        and Domain.from_dict(Domain().as_dict(), where="r") == Domain()
    )
    assert Domain.from_dict({}, where="x") == Domain()  # every key optional: no restriction


@pytest.mark.parametrize(
    "decl,message",
    [
        ({"dtype": ["float16"]}, "unknown domain key(s) dtype; accepted: dtypes, head_dims,"),
        ({"dtypes": ["float32"]}, "'dtypes' = ['float32']: expected a non-empty list of bfloat16, float16,"),
        ({"causal": "yes"}, "'causal' = 'yes': expected true or false"),
        ({"seqlen_multiple": 0}, "'seqlen_multiple' = 0: expected a positive integer"),
        ({"head_dims": []}, "'head_dims' = []: expected an int d (d == dv), a [d, dv] pair, a range {min, max, step}"),
        ({"head_dims": [64, [8]]}, "'head_dims' = [64, [8]] (the item [8]): expected an int d (d == dv), a [d, dv]"),
        ({"head_dims": [0]}, "'head_dims' = [0] (the item 0): expected an int d"),
        ({"head_dims": [True]}, "'head_dims' = [True] (the item True): expected an int d"),
        ({"head_dims": {"min": 16, "max": 8}}, "'head_dims' = {'min': 16, 'max': 8}: expected an int d"),
        ({"head_dims": {"min": 8, "max": 64, "step": 0}}, "expected an int d (d == dv), a [d, dv] pair"),
        ({"head_dims": {"d": {"min": 8, "max": 64, "stride": 8}, "dv": 64}}, "'stride': 8}, 'dv': 64}: expected an"),
        ({"head_dims": {"d": 64}}, "'head_dims' = {'d': 64}: expected an int d (d == dv)"),
        ({"seqlen_k_multiple": -64}, "'seqlen_k_multiple' = -64: expected a positive integer"),
        (
            {"seqlen_multiple": 64, "seqlen_q_multiple": 128},
            "domain keys 'seqlen_multiple' = 64 and 'seqlen_q_multiple' = 128 disagree; give seqlen_multiple (both",
        ),
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

    assert domain_of(k) == Domain(mods=())  # unrestricted, but a kernel takes no mods unless it says so
    k.fa4_audit_domain = TRITON
    assert domain_of(k).seqlen_k_multiple == 128
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
    from audits.suites.inputs import FAMILIES

    assert {c.family for c in r["cases"]} == set(FAMILIES) - {"nan_inf_masked"}
    lengths = {c.seqlen_q for c in r["cases"]}
    assert {128, 384, 640, 8192} <= lengths and max(lengths) <= 8192
    normal = [c for c in r["cases"] if c.family == "normal" and not c.mods]  # the mods suite: docs/mods.md
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
    # a domain taking no mods (a kernel declaring none) has none of the mods suite (its cross-check
    # partners without mods check nothing alone) and no other mod case
    mods = set(mods_suite())
    want = [c for c in release_suite() if not c.mods and c not in mods]
    assert release_within(Domain(mods=()))["cases"] == want


@pytest.mark.slow  # the whole smoke suite in a domain: 86 s CPU
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
    md = (out / "report.md").read_text()  # the Markdown report states the domain and the coverage too
    assert "Suite built within the declared domain (single): dtypes ['float16']" in md
    assert f"Pairs of supported axis values covered: {rep['domain']['pairs_covered']}." in md
    assert "- family nan_inf_masked not applicable:" in md
    narrow = tmp_path / "d64.toml"
    narrow.write_text("head_dims = [[64, 64]]\ncausal = false\n")
    argv = ["run", "--kernel", kern, "--suite", "smoke", "--domain", str(narrow), "--out", str(tmp_path / "n")]
    assert cli.main([*argv, "--quiet"]) == 0
    cases = json.loads((tmp_path / "n" / "report.json").read_text())["cases"]
    assert {(c["config"]["d"], c["config"]["causal"]) for c in cases} == {(64, False)}
    narrow.write_text("head_dim = [[64, 64]]\n")
    assert cli.main([*argv, "--quiet", "--overwrite"]) == 2
    assert "unknown domain key(s) head_dim; accepted: dtypes" in capsys.readouterr().err


@pytest.mark.slow  # job processes: 29 s CPU
def test_a_domain_built_suite_runs_with_jobs_and_resumes(tmp_path):
    """``--jobs`` children get the parent's domain-built cases (through the case file) and
    ``--resume`` continues them: the report holds exactly the cases the domain built."""
    from audits import cli
    from audits.kernels import kernel_domain
    from audits.suites.cases import smoke_within

    kern = "examples/restricted_kernel.py:attention"
    narrow = tmp_path / "d.toml"
    narrow.write_text("head_dims = [[64, 64]]\n")
    argv = ["run", "--kernel", kern, "--suite", "smoke", "--domain", str(narrow), "--jobs", "2", "--quiet"]
    out = tmp_path / "j"
    assert cli.main([*argv, "--out", str(out)]) == 0
    # the kernel's own declaration (kernel_domain: mods it does not declare are none), narrowed
    want = {c.name for c in smoke_within(kernel_domain(kern).narrow(Domain.from_toml(narrow)))["cases"]}
    first = {c["case"]: c["seconds"] for c in json.loads((out / "report.json").read_text())["cases"]}
    assert set(first) == want
    assert cli.main([*argv, "--out", str(out), "--resume"]) == 0
    again = {c["case"]: c["seconds"] for c in json.loads((out / "report.json").read_text())["cases"]}
    assert again == first  # the same cases, none redone


# --- Domain.widen and the built-in kernels' declarations -----------------------------------------


def test_widen_takes_each_keys_more_permissive_value():
    a = Domain.from_dict(TRITON, where="a")
    b = Domain(dtypes=("bfloat16",), head_dims=((64, 64), (96, 96)), seqlen_q_multiple=96, seqlen_k_multiple=96,
               min_seqlen=64, max_seqlen=4096, causal=False, local=True, softcap=False, sink=True, gqa=False,
               layouts=("packed_qkv",), backward=True, deterministic=False)  # fmt: skip
    w = a.widen(b)
    assert w.dtypes == ("float16", "bfloat16") and w.head_dim_pairs() == ((64, 64), (96, 96), (128, 128))
    assert w.seqlen_q_multiple == w.seqlen_k_multiple == 32  # gcd(128, 96)
    assert not w.equal_seqlens  # equal lengths only if both want them
    assert w.min_seqlen == 1 and w.max_seqlen == 8192
    assert w.causal and w.local and not w.softcap and w.sink and w.gqa and w.backward and not w.deterministic
    assert w.layouts == ("contiguous", "strided", "packed_qkv")
    swapped = {"dtypes": ("bfloat16", "float16"), "layouts": ("packed_qkv", "contiguous", "strided")}
    assert b.widen(a) == dataclasses.replace(w, **swapped)  # the same domain, listed in the other order
    assert Domain(dtypes=("float16",), max_seqlen=512).widen(Domain()) == Domain()  # None (any) wins
    assert a.widen(a) == a and Domain(equal_seqlens=True).widen(Domain(equal_seqlens=True)).equal_seqlens
    case = Case("bfloat16", 96, 96, 1, 4, 4, 192, 384, softcap=15.0)  # inside neither a nor b: softcap
    assert "softcap" in w.refusal(case) and w.refusal(dataclasses.replace(case, softcap=0.0)) is None


def _gpu(monkeypatch, major):
    """Pretend this machine has a GPU of compute capability ``major``.x (or none: None)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: major is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))


def test_the_builtin_kernels_declare_their_domains(monkeypatch):
    """fa4 per GPU architecture (resolved when asked), the models, SDPA per backend: what each
    refuses up front, and what stays a run-time refusal."""
    from audits.kernels import KERNELS, kernel_domain

    bf16 = Case("bfloat16", 64, 64, 1, 4, 2, 200, 300, causal=True)
    fp8, hd192, cap, sink, win = (dataclasses.replace(bf16, **kw) for kw in (
        {"dtype": "float8_e4m3fn"}, {"d": 192, "dv": 192}, {"softcap": 15.0}, {"sink": True},
        {"causal": False, "window": (64, 16)}))  # fmt: skip
    _gpu(monkeypatch, 9)  # Hopper: no fp8, every head dim of the suites
    sm90 = kernel_domain("fa4")
    assert "dtype float8_e4m3fn" in sm90.refusal(fp8)
    assert all(sm90.refusal(c) is None for c in (bf16, hd192, cap, sink, win))
    _gpu(monkeypatch, 10)  # Blackwell: fp8, head dims 8..128, (192, 128), (256, 256); not (192, 192)
    sm100 = kernel_domain("fa4")
    assert sm100.refusal(fp8) is None and "head dims (192, 192) not in" in sm100.refusal(hd192)
    for d, dv in ((192, 128), (256, 256), (64, 72), (8, 128), (128, 128)):
        assert sm100.refusal(dataclasses.replace(bf16, d=d, dv=dv)) is None, (d, dv)
    assert sm100.backward and sm100.deterministic and sm90.backward and sm90.deterministic
    _gpu(monkeypatch, None)
    assert kernel_domain("fa4") == Domain(mods=())  # no GPU: production cannot run; nothing declared
    # the SM100 model computes every configuration (the mod kinds it declares: tests/test_mod_cases.py)
    assert dataclasses.replace(kernel_domain("fa4-model"), mods=None) == Domain()
    assert dataclasses.replace(kernel_domain("fa4-model-sm90"), mods=None) == Domain(dtypes=("bfloat16", "float16"))
    with pytest.raises(NotImplementedError, match="only bf16 and fp16"):  # what the declaration replaces
        from audits.suites.inputs import make_inputs

        x = make_inputs(dataclasses.replace(fp8, batch=1, seqlen_q=8, seqlen_k=8), device="cpu")
        KERNELS["fa4-model-sm90"](x["q"], x["k"], x["v"], **x["kw"])
    for be in ("math", "flash", "efficient", "cudnn"):
        d = kernel_domain(f"sdpa-{be}")
        assert "softcap unsupported" in d.refusal(cap) and "learnable sink unsupported" in d.refusal(sink)
        assert "dtype float8_e4m3fn" in d.refusal(fp8) and d.refusal(bf16) is None and d.refusal(hd192) is None
        assert d.backward and not d.deterministic  # SDPA has no deterministic flag
        assert (d.refusal(win) is None) == (be in ("math", "efficient")), be  # a window as a boolean mask


def test_sdpa_flash_refuses_a_softcap_case_before_it_is_called(tmp_path, monkeypatch):
    """The engine skips a case outside the kernel's declared domain without calling it; the
    kernel is called for the cases inside."""

    from audits import kernels
    from audits.engine.options import RunOptions
    from audits.engine.run import run_suites
    from audits.verdict.gate import load_thresholds

    sdpa, calls = kernels.KERNELS["sdpa-flash"], []

    def spy(q, k, v, **kw):
        calls.append(kw)
        return sdpa(q, k, v, **kw)

    spy.fa4_audit_domain = sdpa.fa4_audit_domain
    monkeypatch.setitem(kernels.KERNELS, "sdpa-flash", spy)
    inside = Case("bfloat16", 64, 64, 1, 2, 2, 64, 64, family="normal")
    capped = dataclasses.replace(inside, softcap=15.0)
    options = RunOptions(out=tmp_path, thresholds=load_thresholds(), isolate=False)
    recs = run_suites(["sdpa-flash"], [capped, inside], options)["sdpa-flash"]
    assert recs[0]["verdict"] == "skipped"
    assert recs[0]["reasons"] == ["outside the kernel's declared domain: softcap unsupported"]
    assert len(calls) == 1 and calls[0]["softcap"] == 0.0  # only the case inside was called
    assert not any("declared domain" in why for why in recs[1]["reasons"])


def test_fa4_model_sm90_gets_its_own_smoke_without_fp8():
    """One kernel: the suite is built within its own domain; the report's domain says so."""
    import argparse

    from audits.cli.options import selection_from_args

    sel = selection_from_args(argparse.Namespace(suite="smoke", domain=None), kernels=["fa4-model-sm90"])
    cases, info = sel.cases, sel.domain_info
    assert cases and not any(c.dtype.startswith("float8") for c in cases)
    assert {c.dtype for c in cases} == {"bfloat16", "float16"}
    assert info["rule"] == "single" and info["domain"]["dtypes"] == ["bfloat16", "float16"]
    assert info["pairs_covered"] > 0 and "kernels" not in info


@pytest.mark.slow  # two kernels over a union suite: 38 s CPU
def test_two_kernels_share_one_union_suite_each_skipping_outside_its_domain(tmp_path, capsys):
    """fa4-model (unrestricted) and sdpa-math on smoke: one shared suite over the union of their
    domains (here smoke itself, so fa4-model keeps its softcap, sink and fp8 cases); sdpa-math
    skips exactly the cases outside its own domain, with the declared-domain reason, and both
    reports state the rule and each kernel's domain.  ``--jobs`` children decide alike."""
    from audits import cli
    from audits.suites.cases import smoke_suite

    outside = {c.name for c in smoke_suite() if c.softcap or c.sink or c.dtype.startswith("float8") or c.mods}
    assert len(outside) == 18  # 8 fp8, 2 softcap, 2 sink, 6 mods (smoke_mods' 5, varlen_mods' smoke case)
    out = tmp_path / "two"
    argv = ["run", "--kernel", "fa4-model", "--kernel", "sdpa-math", "--suite", "smoke", "--quiet"]
    cli.main([*argv, "--out", str(out)])
    # outside: SDPA's flags and dtypes, and smoke's 6 mod cases (SDPA declares no mods)
    assert f"sdpa-math skips 18 of {len(smoke_suite())} cases outside its declared domain" in capsys.readouterr().err
    reps = {k: json.loads((out / k / "report.json").read_text()) for k in ("fa4-model", "sdpa-math")}
    assert [c["case"] for c in reps["fa4-model"]["cases"]] == [c.name for c in smoke_suite()]
    assert [c["case"] for c in reps["sdpa-math"]["cases"]] == [c.name for c in smoke_suite()]
    info = reps["sdpa-math"]["domain"]
    # unrestricted: every key open, and every mod kind declared (absent would mean none for a kernel)
    unrestricted = Domain(mods=MOD_KINDS).as_dict()
    assert info == reps["fa4-model"]["domain"] and info["rule"] == "union" and info["domain"] == unrestricted
    sdpa = info["kernels"]["sdpa-math"]
    assert sdpa["domain"]["softcap"] is False and sdpa["cases_outside"] == 18
    assert info["kernels"]["fa4-model"] == {"domain": unrestricted, "cases_outside": 0}
    declared = {c["case"] for c in reps["sdpa-math"]["cases"]
                if c["reasons"][0].startswith("outside the kernel's declared domain: ")}  # fmt: skip
    assert declared == outside
    ran = {c["case"] for c in reps["fa4-model"]["cases"] if c["verdict"] != "skipped"}
    assert outside - {c.name for c in smoke_suite() if c.dtype.startswith("float8")} <= ran  # softcap, sink: audited
    jobs = tmp_path / "jobs"
    cli.main([*argv, "--case", "*drift-seed0", "--jobs", "2", "--out", str(jobs)])
    recs = json.loads((jobs / "sdpa-math" / "report.json").read_text())["cases"]
    drift = {c["case"] for c in recs}
    assert len(drift) == 5 and len(drift & outside) == 4  # records of the children's journals
    assert {c["case"] for c in recs if "declared domain" in c["reasons"][0]} == drift & outside


# --- head dims as sets and ranges; separate length multiples (issue 24) ---------------------------

#: production SM100's head dims in the compact forms (fa4.refusals.SM100_HEAD_DIMS)
SM100_FORMS = [{"d": {"min": 8, "max": 128, "step": 8}, "dv": {"min": 8, "max": 128, "step": 8}}, [192, 128], 256,
               [64, 512], 512]  # fmt: skip
SM100_TOML = """head_dims = [
  {d = {min = 8, max = 128, step = 8}, dv = {min = 8, max = 128, step = 8}},
  [192, 128], 256, [64, 512], 512,
]
"""


def test_head_dims_take_ints_pairs_ranges_and_their_union_in_the_dict_and_toml_forms(tmp_path):
    from audits.suites.domain import HeadDims

    forms = {  # each form -> the pairs it states
        "ints": ([64, 128], {(64, 64), (128, 128)}),
        "pairs": ([[192, 128], [64, 64]], {(192, 128), (64, 64)}),
        "a range, d == dv": ({"min": 8, "max": 30, "step": 8}, {(8, 8), (16, 16), (24, 24)}),
        "a range, step 1 by default": ({"min": 5, "max": 7}, {(5, 5), (6, 6), (7, 7)}),
        "every pair of two ranges": ({"d": {"min": 8, "max": 16, "step": 8}, "dv": 32}, {(8, 32), (16, 32)}),
        "a mix": ([64, [192, 128], {"min": 96, "max": 112, "step": 16}], {(64, 64), (192, 128), (96, 96), (112, 112)}),
    }  # fmt: skip
    for what, (value, pairs) in forms.items():
        d = Domain.from_dict({"head_dims": value}, where="k")
        assert set(d.head_dim_pairs()) == pairs, what
        assert all(d.accepts_head_dims(*p) for p in pairs) and not d.accepts_head_dims(1, 1), what
        assert Domain.from_dict(d.as_dict(), where="report") == d, what  # the dict form reads back equal
    sm100 = Domain.from_dict({"head_dims": SM100_FORMS}, where="k")
    (tmp_path / "d.toml").write_text(SM100_TOML)
    assert Domain.from_toml(tmp_path / "d.toml") == sm100 and len(sm100.head_dim_pairs()) == 260
    assert sm100.as_dict()["head_dims"] == SM100_FORMS  # compact: the pieces, not 260 pairs
    assert str(sm100.head_dims) == (
        "{d in 8..128 step 8 x dv in 8..128 step 8, (192, 128), (256, 256), (64, 512), (512, 512)}"
    )
    assert "head dims (192, 192) not in {d in 8..128 step 8" in sm100.refusal(Case("bfloat16", 192, 192))
    assert Domain().head_dim_pairs() is None and Domain().accepts_head_dims(7, 13)
    assert Domain(head_dims=[(64, 64)]).head_dims == HeadDims.of([(64, 64)]) == HeadDims.parse(64, where="x")


def test_narrow_and_widen_of_head_dims_are_the_exact_intersection_and_union():
    """Random unions of pieces (fixed seed) against the sets they enumerate: ``meet`` and
    ``join`` equal set intersection and union, membership equals ``contains``, and each result
    reads back equal from its dict form."""
    import random

    from audits.suites.domain import HeadDims

    rng = random.Random(24)

    def piece():
        lo = rng.randint(1, 40)
        rng_ = lambda: {"min": lo, "max": lo + rng.randint(0, 40), "step": rng.randint(1, 9)}
        return rng.choice([lambda: rng.randint(1, 60), lambda: [rng.randint(1, 60), rng.randint(1, 60)], rng_,
                           lambda: {"d": rng_(), "dv": rng.choice([rng_(), rng.randint(1, 60)])}])()  # fmt: skip

    grid = list(itertools.product(range(1, 90), repeat=2))
    for _ in range(60):
        a = HeadDims.parse([piece() for _ in range(rng.randint(1, 4))], where="a")
        b = HeadDims.parse([piece() for _ in range(rng.randint(1, 4))], where="b")
        sa, sb = set(a.pairs()), set(b.pairs())
        assert {p for p in grid if a.contains(*p)} == {p for p in grid if p in sa}
        meet, join = a.meet(b), a.join(b)
        assert set(meet.pairs()) == sa & sb and set(join.pairs()) == sa | sb, (a, b)
        for x in (meet, join):
            if len(x):
                assert HeadDims.parse(x.as_value(), where="x") == x
    da, db = Domain(head_dims=a), Domain(head_dims=b)
    assert da.narrow(db).head_dims == meet and da.widen(db).head_dims == join
    assert da.narrow(Domain()).head_dims == a and da.widen(Domain()).head_dims is None  # None: any


def test_query_and_key_lengths_have_their_own_multiples():
    shorthand = Domain.from_dict({"seqlen_multiple": 64}, where="k")
    assert shorthand == Domain.from_dict({"seqlen_q_multiple": 64, "seqlen_k_multiple": 64}, where="k")
    assert Domain.from_dict({"seqlen_multiple": 64, "seqlen_k_multiple": 64}, where="k") == shorthand  # agreeing
    keys64 = Domain.from_dict({"seqlen_k_multiple": 64}, where="k")
    case = Case("bfloat16", 64, 64, 1, 2, 2, 100, 128)
    assert keys64.refusal(case) is None  # queries free
    assert keys64.refusal(dataclasses.replace(case, seqlen_k=100)) == "seqlen_k 100 not a multiple of 64"
    q32 = Domain(seqlen_q_multiple=32)
    assert q32.refusal(case) == "seqlen_q 100 not a multiple of 32"
    assert shorthand.refusal(case) == "seqlens 100x128 not multiples of 64"
    both = keys64.narrow(Domain(seqlen_q_multiple=3, seqlen_k_multiple=48))
    assert (both.seqlen_q_multiple, both.seqlen_k_multiple) == (3, 192)  # lcm of each
    either = keys64.widen(Domain(seqlen_q_multiple=3, seqlen_k_multiple=48))
    assert (either.seqlen_q_multiple, either.seqlen_k_multiple) == (1, 16)  # gcd of each


def test_keys_in_blocks_of_64_and_free_queries_get_partial_query_blocks():
    """A domain "seqlen_k a multiple of 64, seqlen_q free": the suites built in it have queries
    that are not multiples of 64 (partial query blocks) as well as multiples, every case inside."""
    from audits.suites.cases import smoke_within
    from audits.suites.domain import seqlens_within

    d = Domain.from_dict({"seqlen_k_multiple": 64, "max_seqlen": 1024}, where="k")
    lengths = seqlens_within(d, [])
    assert all(sk % 64 == 0 for _, sk in lengths)
    assert {sq % 64 != 0 for sq, _ in lengths} == {True, False}
    assert (32, 64) in lengths and (96, 64) in lengths  # one block, half a block short and over
    same = Domain.from_dict({"seqlen_multiple": 64}, where="k")  # one multiple for both: no partial block
    assert all(sq % 64 == 0 == sk % 64 for sq, sk in seqlens_within(same, []))
    for built in (smoke_within(d), release_within(d)):
        fixed = [c for c in built["cases"] if not c.varlen]
        assert all(d.refusal(c) is None for c in built["cases"])
        assert any(c.seqlen_q % 64 for c in fixed) and any(c.seqlen_q % 64 == 0 for c in fixed)
    keys_free = Domain(seqlen_q_multiple=128)  # the other way round: partial key blocks
    assert {sk % 128 != 0 for _, sk in seqlens_within(keys_free, [])} == {True, False}


def test_smoke_pairs_each_nonfinite_family_with_every_mask_the_domain_supports():
    """The issue's restricted kernel (fp16, d in {64, 128}, equal lengths in multiples of 128,
    causal): its smoke has nan_inf_visible both causal and not (a kernel masking causally by
    adding -1e6 turns earlier rows NaN from a NaN key beyond the diagonal); a domain with
    windows gets a local one too, one without causal masking none."""
    from audits.suites.cases import mask_kind, smoke_within

    d = Domain.from_dict({"dtypes": ["float16"], "head_dims": [64, 128], "seqlen_multiple": 128,
                          "equal_seqlens": True, "causal": True, "local": False}, where="k")  # fmt: skip
    cases = smoke_within(d)["cases"]
    assert all(d.refusal(c) is None for c in cases)
    assert {mask_kind(c) for c in cases if c.family == "nan_inf_visible"} == {"none", "causal"}
    wide = smoke_within(dataclasses.replace(d, local=True, equal_seqlens=False))["cases"]
    assert {mask_kind(c) for c in wide if c.family == "nan_inf_visible"} == {"none", "causal", "local"}
    plain = smoke_within(dataclasses.replace(d, causal=False))["cases"]
    assert {mask_kind(c) for c in plain if c.family == "nan_inf_visible"} == {"none"}


def test_the_head_dim_sweep_within_a_domain():
    """``head-dims`` in a domain: (x, x) for every accepted x, else every accepted pair with
    that d (SM100's (192, 128)); the 16-bit dtypes; causal only where supported; each case moved
    into the domain's lengths.  Unrestricted, it is the named suite; nightly includes it."""
    from audits.suites.cases import build_suite, head_dim_sweep, head_dims_within, suite, sweep_head_dims

    sm100 = Domain.from_dict({"head_dims": SM100_FORMS}, where="k")
    pairs = sweep_head_dims(sm100)
    assert pairs == [(x, x) for x in range(8, 129, 8)] + [(192, 128), (256, 256), (512, 512)]
    assert sweep_head_dims(Domain()) == [(x, x) for x in range(8, 257, 8)]  # production SM90's
    assert sweep_head_dims(Domain(head_dims=[(96, 64), (96, 32)])) == [(96, 32), (96, 64)]
    d = Domain.from_dict({"dtypes": ["float16", "float8_e4m3fn"], "head_dims": [64, 128], "seqlen_multiple": 128,
                          "equal_seqlens": True, "causal": False, "gqa": False}, where="k")  # fmt: skip
    built = head_dims_within(d)
    assert built["axes"] == {"d": [(64, 64), (128, 128)], "dtype": ["float16"], "mask": ["none"]}
    assert len(built["cases"]) == 2 and all(d.refusal(c) is None for c in built["cases"])
    assert {(c.d, c.seqlen_q, c.seqlen_k, c.heads_q, c.heads_kv) for c in built["cases"]} == {
        (64, 128, 128, 4, 4), (128, 128, 128, 4, 4)}  # fmt: skip
    fp8 = head_dims_within(Domain(dtypes=("float8_e4m3fn",)))
    assert fp8["cases"] == [] and "the head-dim sweep runs bfloat16 and float16" in fp8["not_applicable"]["head-dims"]
    assert build_suite("head-dims", Domain())["cases"] == suite("head-dims")
    sweep = set(head_dim_sweep(pairs=[(64, 64)], dtypes=("bfloat16",), masks=("none",)))
    nightly = set(suite("nightly", Domain(head_dims=[64], dtypes=("bfloat16",))))
    assert sweep <= nightly


def test_release_within_a_domain_adds_the_class_cases_inside_it():
    from audits.suites.cases import class_cases

    d = Domain.from_dict({"dtypes": ["bfloat16"], "head_dims": {"min": 8, "max": 256, "step": 8}}, where="k")
    inside = [c for c in class_cases() if d.refusal(c) is None]
    assert inside and len(inside) < len(class_cases())  # some lie outside (fp16, fp8, d != dv)
    cases = set(release_within(d)["cases"])
    assert set(inside) <= cases and all(d.refusal(c) is None for c in cases)


def test_a_domain_is_an_immutable_value():
    d = Domain.from_dict({"dtypes": ["float16"], "head_dims": [64, [96, 64]], "seqlen_multiple": 128}, where="t")
    same = Domain(dtypes=("float16",), head_dims=[(64, 64), (96, 64)], seqlen_q_multiple=128, seqlen_k_multiple=128)
    assert d == same and hash(d) == hash(same) and {d: 1}[same] == 1
    assert Domain.from_dict(d.as_dict(), where="t") == d
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.dtypes = ("bfloat16",)
    assert d != Domain() and Domain() == Domain()


def test_a_run_reads_the_domain_file_once_and_resolves_each_kernel_once(tmp_path, monkeypatch):
    """``run --domain FILE``: the file is parsed once (the case selection), and each kernel's
    domain resolved once outside the engine (the selection's, reused by the coverage bases)."""
    import sys

    import audits.kernels
    import audits.suites.domain
    from audits import cli

    reads, resolved = [], []
    read_toml, domain_of = audits.suites.domain.read_toml, audits.kernels.domain_of

    def counting_read(path, **kw):
        reads.append((str(path), kw.get("what")))
        return read_toml(path, **kw)

    def counting_domain_of(fn):
        caller = sys._getframe(1).f_back.f_globals.get("__name__", "")  # kernel_domain's caller
        resolved.append(caller)
        return domain_of(fn)

    monkeypatch.setattr(audits.suites.domain, "read_toml", counting_read)
    monkeypatch.setattr(audits.kernels, "domain_of", counting_domain_of)
    f = tmp_path / "d.toml"
    f.write_text('dtypes = ["bfloat16"]\n')
    config = '{"d": 64, "dv": 64, "seqlen_q": 20, "seqlen_k": 36}'
    argv = ["run", "--kernel", "sdpa-math", "--domain", str(f), "--config", config, "--out", str(tmp_path / "o")]
    assert cli.main([*argv, "--quiet"]) == 0
    assert reads == [(str(f), "domain")]
    assert [c for c in resolved if not c.startswith("audits.engine")] == ["audits.suites.selection"]
