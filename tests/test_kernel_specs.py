"""Kernel specs for comparing releases and variants (issue 34): model variants
``MODEL:knob=value,...`` (parsed up front, run and bounded with their own numerics, judged as
their model), production from another installation ``fa4@DIR`` (checked without importing it,
imported only in a worker, each report naming its release), and the releases the model's
bit-faithful claims were verified against (``fa4.releases``)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from audits import cli
from audits import kernels as K
from audits.common import UsageError
from audits.engine import evaluate
from audits.engine.options import RunOptions
from audits.engine.run import kernel_dir
from audits.engine.worker import InProcess, isolated_by_default, isolation, open_kernel
from audits.report.build import build_report
from audits.report.header import kernel_environment, versions_line
from audits.suites.case import Case, varlen_case
from audits.suites.inputs import make_inputs
from audits.suites.selection import select_cases
from audits.verdict.gate import load_thresholds
from fa4.knobs import FA4Numerics
from fa4.releases import VERIFIED_RELEASES, VERIFIED_VERSIONS, release_note

ROOT = Path(__file__).resolve().parents[1]
NORMAL = "bf16-d64-b2h4k2-s200x300-causal-normal-seed0"  # tests/test_contract.py's


# ---- model variants ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("fa4-model:foo=1", "unknown knob 'foo'; accepted knobs: poly_degree, rescale_threshold, max_offset, tile_m"),
        ("fa4-model:poly_degree=7", "poly_degree=7: expected one of 1, 2, 3, 4, 5"),
        ("fa4-model:poly_degree=three", "poly_degree=three: expected one of 1, 2, 3, 4, 5"),
        ("fa4-model:tile_n=12", "tile_n=12: expected a positive multiple of 8"),
        ("fa4-model:rescale_threshold=-1", "rescale_threshold=-1: expected a finite number >= 0"),
        ("fa4-model:rescale_threshold=inf", "rescale_threshold=inf: expected a finite number >= 0"),
        ("fa4-model-sm90:p_dtype=float32", "p_dtype=float32: expected one of bfloat16, float16, float8_e4m3fn"),
        ("fa4-model:exp2=fast", "exp2=fast: expected one of mixed, emulated, hardware"),
        ("fa4-model-sm90-tc:mma=wgmma", "mma=wgmma: expected one of exact, tensor_core"),
        ("fa4-model:", "'' is not knob=value (a model variant is fa4-model:knob=value[,knob=value...])"),
        ("fa4-model:poly_degree", "'poly_degree' is not knob=value"),
        ("fa4-model:mma=exact,mma=exact", "knob 'mma' given twice"),
    ],
)
def test_a_malformed_variant_is_refused_up_front_naming_what_is_accepted(spec, says):
    """Every malformed variant fails at get_kernel (before any case), naming the spec, the knob or
    value and what is accepted; ``run`` turns it into exit 2."""
    with pytest.raises(ValueError) as err:
        K.get_kernel(spec)
    assert f"kernel {spec!r}" in str(err.value) and says in str(err.value)
    with pytest.raises(UsageError, match=re.escape(says)):
        K.usable_kernels([spec])


def test_fa4_numerics_own_checks_are_applied_to_a_variant(monkeypatch):
    """Beyond the knobs' own parsers, the variant's numerics pass FA4Numerics' validation
    (``__post_init__``): a check added there refuses a variant too."""

    def stricter(self):
        if self.tile_m > 256:
            raise ValueError(f"tile_m must be <= 256, got {self.tile_m}")

    monkeypatch.setattr(FA4Numerics, "__post_init__", stricter)
    K._parse_variant.cache_clear()
    with pytest.raises(ValueError, match=r"kernel 'fa4-model:tile_m=512': tile_m must be <= 256, got 512"):
        K.model_overrides("fa4-model:tile_m=512")
    K._parse_variant.cache_clear()


def test_a_variant_is_its_model_by_name():
    """A variant is judged and run as its model: in this process, FA4's NaN claim, the model's
    arch (coverage), one kernel object per spec; ``module:attr`` stays a user kernel."""
    spec = "fa4-model-sm90:poly_degree=5,p_dtype=float16"
    assert K.model_overrides(spec) == {"poly_degree": 5, "p_dtype": torch.float16}
    assert K.model_overrides("fa4-model") == {} and K.model_overrides("tests.bugged_kernels:exact") == {}
    assert K.base_kernel(spec) == "fa4-model-sm90" and K.base_kernel("mod:fa4-model") == "mod:fa4-model"
    assert not isolated_by_default(spec) and isolated_by_default("tests.bugged_kernels:exact")
    assert K.claims_nonfinite_inputs(spec)
    assert K.fa4_arch(spec) == "sm90" and K.fa4_arch("fa4-model:mma=tensor_core") == "sm100"
    fn = K.get_kernel(spec)
    assert fn is K.get_kernel(spec) and fn is not K.KERNELS["fa4-model-sm90"]
    assert fn.fa4_audit_arch == "sm90" and K.kernel_domain(spec) == K.kernel_domain("fa4-model-sm90")
    assert K.portable_spec(spec) == spec
    assert kernel_dir("out", spec, True) == Path("out/fa4-model-sm90.poly_degree=5,p_dtype=float16")


def _small(dtype=torch.bfloat16, sk=256):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 2, 64, generator=g).to(dtype) for n in (64, sk, sk))
    return q, k, v


def test_a_variant_runs_its_own_numerics():
    """``fa4-model:poly_degree=5`` runs the degree-5 exp2 where production uses degree 3: its
    outputs differ from the model's on the same inputs, and equal the model run with that
    FA4Numerics by hand (the overrides applied after production's choice for the call)."""
    q, k, v = _small()
    base, lse = K.get_kernel("fa4-model")(q, k, v, return_lse=True)
    var, vlse = K.get_kernel("fa4-model:poly_degree=5")(q, k, v, return_lse=True)
    assert not torch.equal(base, var) and not torch.equal(lse, vlse)
    from fa4.model import attention

    nm = dataclasses.replace(FA4Numerics.for_call("sm100", q, k, v), poly_degree=5)
    assert torch.equal(var, attention(q, k, v, numerics=nm))


def test_the_bound_analyses_the_variants_numerics():
    """The runner bounds a variant with the numerics it runs (``_fa4_numerics``): production's
    choice for the call with the overrides on top, for fixed-length and varlen cases."""
    case = Case("bfloat16", 64, 64, 1, 2, 2, 64, 256, causal=True)
    x = make_inputs(case)
    prod = evaluate._fa4_numerics("fa4-model", x, case)
    got = evaluate._fa4_numerics("fa4-model:rescale_threshold=0,tile_n=64", x, case)
    assert prod.rescale_threshold == 8.0 and prod.tile_n == 128
    assert got == dataclasses.replace(prod, rescale_threshold=0.0, tile_n=64)
    q, k, v = _small()
    nmf = K.fa4_varlen_numerics("fa4-model:rescale_threshold=0")
    kw = dict(num_splits=1, page_size=0, pack_gqa=None, max_seqlen_q=64)
    seq = nmf(q, k, v, False, (None, None), **kw)
    assert seq.rescale_threshold == 0.0
    plain = K.fa4_varlen_numerics("fa4-model")(q, k, v, False, (None, None), **kw)
    assert seq == dataclasses.replace(plain, rescale_threshold=0.0)
    assert K.fa4_numerics("fa4-model:poly_degree=5")(q, k, v, False, (None, None)).poly_degree == 5


def test_a_variant_has_a_varlen_entry_with_its_knobs():
    """A variant's varlen entry runs its knobs per sequence (``fa4.varlen``'s overrides): it
    differs from the model's entry, and the engine finds it for the variant run in this process."""
    case = varlen_case(seqlens=((40, 256), (64, 200)), d=64, dv=64)
    from audits.suites.inputs import make_varlen_inputs

    x = make_varlen_inputs(case)
    base = K.get_varlen_kernel("fa4-model")(x["q"], x["k"], x["v"], **x["kw"])
    var = K.get_varlen_kernel("fa4-model:poly_degree=1")(x["q"], x["k"], x["v"], **x["kw"])
    assert not torch.equal(base, var)
    spec = "fa4-model:poly_degree=1"
    entry, kind = InProcess(spec, K.get_kernel(spec)).varlen_entry(False)
    assert kind == "varlen" and entry is K.get_varlen_kernel(spec)


def test_run_audits_a_variant_beside_its_model(tmp_path):
    """Two kernels in one run: each report under its own directory, the variant's named after it."""
    out = tmp_path / "out"
    argv = ["run", "--quiet", "--kernel", "fa4-model", "--kernel", "fa4-model:poly_degree=1", "--case", NORMAL]
    assert cli.main([*argv, "--out", str(out)]) in (0, 1)
    reps = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/report.json")}
    assert set(reps) == {"fa4-model", "fa4-model.poly_degree=1"}
    assert reps["fa4-model.poly_degree=1"]["kernel"] == "fa4-model:poly_degree=1"
    a, b = (reps[n]["cases"][0]["out"]["max_abs"] for n in ("fa4-model", "fa4-model.poly_degree=1"))
    assert a != b


# ---- fa4@DIR -------------------------------------------------------------------------------


def fake_release(root: Path, version: str = "4.0.0b36", *, metadata: bool = True) -> Path:
    """A ``pip install --target`` tree of flash-attn-4 ``version`` whose code raises when imported
    (so that a test sees any import), its metadata as pip writes it."""
    cute = root / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    for name in ("__init__.py", "interface.py"):
        (cute / name).write_text("raise ImportError('the fake release was imported')\n")
    dist = root / f"flash_attn_4-{version}.dist-info"
    dist.mkdir()
    if metadata:
        (dist / "METADATA").write_text(f"Metadata-Version: 2.4\nName: flash-attn-4\nVersion: {version}\n\nbody\n")
    return root


def test_kernel_versions_read_the_release_without_importing_it(tmp_path):
    """``fa4@DIR``'s release comes from DIR's metadata (else the dist-info's name), its compiler
    too when DIR holds one; nothing of DIR is imported by the kernel's checks, arch or domain."""
    d = fake_release(tmp_path / "b36")
    spec = f"fa4@{d}"
    assert K.kernel_versions(spec) == {"flash-attn-4": "4.0.0b36"}
    (d / "nvidia_cutlass_dsl-4.8.1.dist-info").mkdir()
    (d / "nvidia_cutlass_dsl-4.8.1.dist-info" / "METADATA").write_text("Name: nvidia-cutlass-dsl\nVersion: 4.8.1\n")
    assert K.kernel_versions(spec) == {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1"}
    bare = fake_release(tmp_path / "b40", "4.0.0b40", metadata=False)
    assert K.kernel_versions(f"fa4@{bare}") == {"flash-attn-4": "4.0.0b40"}
    assert K.kernel_versions("fa4-model") is None and K.kernel_versions("sdpa-math") is None
    fn = K.get_kernel(spec)
    assert fn is K.get_kernel(spec) and fn.fa4_audit_release == d.resolve()
    assert fn.fa4_audit_refusals is K.REFUSALS and fn.fa4_audit_domain is K.production_domain
    assert K.get_varlen_kernel(spec).fa4_audit_contract == "varlen"
    assert K.fa4_arch(spec) == K.fa4_arch("fa4") and K.base_kernel(spec) == "fa4"
    K.kernel_domain(spec)
    assert not any(str(d) in str(getattr(m, "__file__", "") or "") for m in list(sys.modules.values()))
    assert str(d) not in sys.path


@pytest.mark.parametrize(
    ("make", "missing"),
    [
        (lambda p: p / "nowhere", "does not exist"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "holds no flash_attn/cute/interface.py"),
        (lambda p: _without_dist(fake_release(p / "r")), "holds no flash_attn_4-*.dist-info"),
        (lambda p: _two_dists(fake_release(p / "r")), "holds 2 flash_attn_4-*.dist-info"),
    ],
)
def test_a_bad_release_dir_is_a_usage_error_naming_it_and_the_fix(tmp_path, make, missing):
    d = make(tmp_path)
    with pytest.raises(UsageError) as err:
        K.usable_kernels([f"fa4@{d}"])
    msg = str(err.value)
    assert str(d.resolve()) in msg and missing in msg
    assert f"pip install --no-deps --target {d.resolve()} flash-attn-4==VERSION" in msg


def _without_dist(d: Path) -> Path:
    for p in d.glob("*.dist-info/*"):
        p.unlink()
    for p in d.glob("*.dist-info"):
        p.rmdir()
    return d


def _two_dists(d: Path) -> Path:
    (d / "flash_attn_4-4.0.0b40.dist-info").mkdir()
    return d


def test_fa4_at_dir_runs_only_in_a_worker(tmp_path, monkeypatch, capsys):
    """``fa4@DIR`` is isolated by default; ``--no-isolate`` beside it is a usage error naming the
    fix; the audit's own process never calls it (open_kernel refuses, the adapter refuses)."""
    spec = f"fa4@{fake_release(tmp_path / 'b36')}"
    assert isolated_by_default(spec)
    assert isolation(None, None, True, kernels=[spec])(spec) is True  # --timeout 0: a worker without a limit
    assert isolation(None, 300.0, False, kernels=[spec])(spec) is True
    with pytest.raises(ValueError, match="runs only in a worker process .*: drop --no-isolate"):
        RunOptions(isolate=False).isolation(kernels=[spec])
    assert RunOptions(isolate=False).isolation(kernels=["fa4-model"]) is False
    with pytest.raises(UsageError, match="runs only in a worker process .*give --timeout SECONDS"):
        open_kernel(spec, "cpu", isolated=False, timeout=None)
    with pytest.raises(RuntimeError, match="runs only in a worker process"):
        K.get_kernel(spec)(*_small())
    monkeypatch.setattr(K, "_usable_releases", lambda specs: None)  # no CUDA here: past that check
    argv = ["run", "--quiet", "--no-isolate", "--kernel", spec, "--case", NORMAL, "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    assert f"{spec} runs only in a worker process" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_fa4_at_dir_needs_cuda(tmp_path, monkeypatch):
    spec = f"fa4@{fake_release(tmp_path / 'b36')}"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=rf"--kernel {re.escape(spec)} is production FA4, which cannot run here"):
        K.usable_kernels([spec])


def test_release_dirs_get_report_directories_of_their_own(tmp_path, monkeypatch, capsys):
    """``fa4@DIR``'s report goes to OUT/fa4@<DIR's name>; two kernels of one name are refused;
    a release outside the verified ones is said on stderr."""
    a, b = fake_release(tmp_path / "b36"), fake_release(tmp_path / "other" / "b36")
    assert kernel_dir("out", f"fa4@{a}/", True) == Path("out/fa4@b36")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UsageError, match="two directories named 'b36', whose reports would share OUT/fa4@b36"):
        K.usable_kernels([f"fa4@{a}", f"fa4@{b}"], domains=False)
    rel = os.path.relpath(a)
    with pytest.raises(UsageError, match="the same directory twice"):
        K.usable_kernels([f"fa4@{a}", f"fa4@{rel}"], domains=False)
    new = fake_release(tmp_path / "b41", "4.0.0b41")
    assert K.usable_kernels([f"fa4@{a}", f"fa4@{new}"], domains=False) == [f"fa4@{a}", f"fa4@{new}"]
    err = capsys.readouterr().err
    assert f"fa4@{new}: note: flash-attn-4 4.0.0b41 is not among the releases" in err and "4.0.0b36 is" not in err
    assert K.portable_spec(f"fa4@{rel}") == f"fa4@{a.resolve()}"


_WORKER = """
import importlib.metadata, sys
from audits import kernels
from fa4.refusals import production_version
spec = sys.argv[1]
kernels.enter_worker_process()
kernels._use_release(spec, kernels.release_dir(spec))
import importlib.util
print(sys.path[0], importlib.util.find_spec("flash_attn.cute").origin, production_version(), sep="\\n")
"""


def test_a_worker_imports_the_release_from_dir(tmp_path):
    """In a worker, DIR goes first on sys.path before flash_attn is imported: flash_attn.cute
    resolves to DIR's and the refusal rules' release (``production_version``) is DIR's."""
    d = fake_release(tmp_path / "b40", "4.0.0b40")
    res = subprocess.run(
        [sys.executable, "-c", _WORKER, f"fa4@{d}"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    first, origin, ver = res.stdout.split()
    assert first == str(d.resolve()) and origin == str(d.resolve() / "flash_attn" / "cute" / "__init__.py")
    assert ver == "4.0.0b40"


# ---- each report names its release; the verified releases ----------------------------------


def test_each_report_records_its_kernels_release(tmp_path):
    """The audit process's environment, as each kernel's report records it: ``fa4@DIR``'s
    versions are DIR's (and its directory); an unverified production release carries its note,
    in the environment and in the versions line; other kernels' environments are unchanged."""
    env = {"fa4_audit": "0.1.0", "versions": {"fa4-audit": "0.1.0", "flash-attn-4": "4.0.0b40", "torch": "2.13"}}
    d = fake_release(tmp_path / "b41", "4.0.0b41")
    got = kernel_environment(environment=env, kernel=f"fa4@{d}")
    assert got["versions"]["flash-attn-4"] == "4.0.0b41" and got["flash_attn_dir"] == str(d.resolve())
    assert got["release_note"] == release_note("4.0.0b41") and env["versions"]["flash-attn-4"] == "4.0.0b40"
    assert "(note: flash-attn-4 4.0.0b41 is not among the releases" in versions_line(got)
    assert kernel_environment(environment=env, kernel="fa4") == env  # b40: verified, no note
    head = dict(device="cuda", thresholds=load_thresholds(), command="fa4-audit run", created="now", shard=None)
    rep = build_report(kernel=f"fa4@{d}", suite="s", seed=0, environment=env, records=[], **head)
    assert rep["environment"] == got  # what the report records, whichever way it was built
    assert kernel_environment(environment=env, kernel="fa4-model:poly_degree=5") == env
    for p in sorted(d.rglob("*"), reverse=True):  # rebuilt where DIR is gone: what it recorded stands
        p.unlink() if p.is_file() else p.rmdir()
    assert kernel_environment(environment=got, kernel=f"fa4@{d}") == got


def test_production_s_known_defects_apply_to_fa4_at_dir():
    """A known-defect entry for ``fa4`` applies to ``fa4@DIR`` too (by its recorded release),
    not to another kernel: both sides of a comparison are judged under the same file."""
    from audits.verdict.known import _applies, load_known

    entry = next(e for e in load_known("fa4").entries if e.kernels == ("fa4",))
    _, _, versions = entry.compiled("known_fa4.toml")
    env = {"versions": {"flash-attn-4": "4.0.0b36", "torch": "2.11.0+cu130"}}
    report = {"kernel": "fa4@/opt/b36", "device": "cuda", "environment": env}
    assert _applies(entry, versions, report) is None
    assert "is not one of fa4" in _applies(entry, versions, {**report, "kernel": "fa4-model-sm90"})


def test_release_notes_for_releases_outside_the_verified_ones():
    assert VERIFIED_VERSIONS == ("4.0.0b36", "4.0.0b40")
    assert release_note("4.0.0b36") is None and release_note("4.0.0b40") is None and release_note(None) is None
    assert release_note("4.0.0b41") == (
        "flash-attn-4 4.0.0b41 is not among the releases the model's bit-faithful claims were verified against "
        "(4.0.0b36, 4.0.0b40): model comparisons are unverified there"
    )


def test_the_verified_table_cites_its_evidence_and_the_gpu_extra_accepts_it():
    """Each claim's evidence names a doc and section that exist; the ``gpu`` extra admits every
    verified release and none outside the range (pip's pre-release semantics)."""
    for v in VERIFIED_RELEASES:
        assert v.releases and set(v.releases) <= set(VERIFIED_VERSIONS)
        for doc, section in re.findall(r"(docs/[\w-]+\.md), '([^']+)'", v.evidence):
            assert section in (ROOT / doc).read_text(), (doc, section)
    assert "4.0.0b36" in {r for v in VERIFIED_RELEASES if v.claim.startswith("backward") for r in v.releases}
    text = (ROOT / "docs" / "model-and-fidelity.md").read_text()
    assert "## Releases verified" in text and all(v.claim.split(":")[0] in text for v in VERIFIED_RELEASES)
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    spec = SpecifierSet(next(r for r in gpu if r.startswith("flash-attn-4")).removeprefix("flash-attn-4"))
    assert all(spec.contains(v) for v in VERIFIED_VERSIONS)
    assert not any(spec.contains(v) for v in ("4.0.0b35", "4.0.0b41", "4.0.0"))


# ---- on the GPU: a real release from DIR ----------------------------------------------------

B36 = os.environ.get("FA4_B36_DIR")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not B36, reason="set FA4_B36_DIR to a pip install --no-deps --target DIR flash-attn-4==4.0.0b36")
def test_fa4_at_a_b36_dir_runs_through_its_worker(tmp_path):
    """``fa4@$FA4_B36_DIR`` beside ``fa4`` in one run: the b36 release imported in its worker (a
    probe process shows DIR's module and release), each report naming its own release."""
    res = subprocess.run(
        [sys.executable, "-c", _WORKER, f"fa4@{B36}"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[1].startswith(str(Path(B36).resolve())) and res.stdout.split()[2] == "4.0.0b36"
    out = tmp_path / "out"
    # the case by its config, not its name: on a GPU the suite is built in production's domain for
    # that GPU, whose smoke cases are not the CPU's (on the H200, 2026-12-04, NORMAL was none of them)
    config = json.dumps(select_cases(suite="smoke", kernels=["fa4-model"], case_glob=NORMAL).cases[0].as_dict())
    argv = ["run", "--quiet", "--device", "cuda", "--kernel", "fa4", "--kernel", f"fa4@{B36}", "--config", config]
    assert cli.main([*argv, "--out", str(out)]) == 0
    mine = json.loads((out / f"fa4@{Path(B36).resolve().name}" / "report.json").read_text())
    assert mine["environment"]["versions"]["flash-attn-4"] == "4.0.0b36"
    assert mine["cases"][0]["verdict"] == "pass"
    installed = json.loads((out / "fa4" / "report.json").read_text())["environment"]["versions"]["flash-attn-4"]
    assert installed == K.kernel_versions("fa4")["flash-attn-4"]


def test_a_user_kernel_declaring_fa4_numerics_is_held_to_fa4s_bound(tmp_path, capsys):
    """``fn.fa4_audit_numerics = "sm100"``: judged as the model is (FA4's bound), not as a peer;
    a value that is no FA4 numerics family is a usage error naming the ones accepted."""
    from audits import cli
    from audits.kernels import fa4_arch

    assert fa4_arch("tests/compare_kernels.py:same") == "sm100"
    bad = tmp_path / "bad.py"
    bad.write_text("def k(q, k, v, **kw):\n    return None\nk.fa4_audit_numerics = 'sm80'\n")
    assert cli.main(["run", "--kernel", f"{bad}:k", "--suite", "smoke", "--out", str(tmp_path / "o")]) == 2
    assert "fa4_audit_numerics = 'sm80'; accepted: sm90, sm100" in capsys.readouterr().err
