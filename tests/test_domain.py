"""audits.domain: a kernel's declared domain — parsed and checked (errors name the key, the value,
where it came from and what is accepted), narrowed by a file, and each axis's refusal."""

import dataclasses

import pytest

from audits.cases import Case, release_suite
from audits.domain import Domain, DomainError, domain_of

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
