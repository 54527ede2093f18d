"""The static audit's report in Markdown: the compile groups of ``fa4-audit static`` (forward,
``fa4-audit/static/1``) or ``static --backward`` (``fa4-audit/static-backward/1``), each with its
verdict and facts, the divergences first."""

from __future__ import annotations

__all__ = ["static_markdown", "backward_markdown"]


def _markdown_head(rep: dict, title: str) -> list[str]:
    """Title, command, versions, the summary line and the divergences table."""
    s = rep["summary"]
    L = [
        f"# fa4-audit static: {title}",
        "",
        f"`{rep['command']}` on {rep['created']}; flash-attn-4 {rep['versions']['flash-attn-4']}, "
        f"nvidia-cutlass-dsl {rep['versions']['nvidia-cutlass-dsl']}; compiled on {rep['compile_on']}.",
        "",
        f"{s['match']} compile groups match, {s['diverged']} diverged, {s['skipped']} skipped "
        "(production refuses the configuration)"
        + (
            f"; {s['fp8_cases_not_audited']} fp8 cases not audited (no fp8 backward)."
            if "fp8_cases_not_audited" in s
            else "."
        ),
        "",
    ]
    bad = [r for r in rep["groups"] if r["verdict"] == "diverged"]
    if bad:
        L += ["## Divergences", "", "| group | fact | production | model |", "|---|---|---|---|"]
        L += [
            f"| {r['group']} | {d['fact']} | `{d['production']}` | `{d['model']}` |"
            for r in bad
            for d in r["differences"]
        ]
        L.append("")
    return L


def static_markdown(rep: dict) -> str:
    """The Markdown of a forward static report (schema ``fa4-audit/static/1``)."""
    L = _markdown_head(rep, "production SM100 forward PTX against FA4Numerics.sm100")
    L += [
        "## Compile groups",
        "",
        "| group | cases | verdict | 2-CTA | emulated/step | degree | threshold | max_offset | P convert "
        "| ex2 hw | steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["groups"]:
        if r["verdict"] == "skipped":
            L.append(f"| {r['group']} | {r['cases']} | skipped: {r['reason'][:80]} | | | | | | | | |")
            continue
        f = r["facts"]
        L.append(
            f"| {r['group']} | {r['cases']} | {r['verdict']} | {r['production'].get('use_2cta_instrs')} "
            f"| {f['exp2.emulated_per_step']:g}/{r['production'].get('n_block_size')} "
            f"| {f['exp2.poly_degree']} | {f['rescale.threshold']} | {f['max_offset']} "
            f"| {', '.join(f['p_convert'])} | {sum(f['exp2.hardware'].values())} | {f['softmax.steps']} |"
        )
    return "\n".join(L) + "\n"


def backward_markdown(rep: dict) -> str:
    """The Markdown of a backward static report (schema ``fa4-audit/static-backward/1``)."""
    L = _markdown_head(rep, "production SM100 backward PTX against the backward model (fa4.model_bwd)")
    L += [
        "## Compile groups",
        "",
        "| group | cases | verdict | main kernel | tiles (m, n, dQ keys) | ex2 hw | P / dS convert | out convert "
        "| f32 reduce targets | tanh | compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["groups"]:
        if r["verdict"] == "skipped":
            why = r["reason"].rsplit("): ", 1)[-1][:110]  # the refusal's own message
            L.append(f"| {r['group']} | {r['cases']} | skipped: {why} | | | | | | | | |")
            continue
        f = r["facts"]
        t, ex2 = f["tiles"], ", ".join(f"{k} x{n}" for k, n in f["exp2.hardware"].items())
        L.append(
            f"| {r['group']} | {r['cases']} | {r['verdict']} | {r['kernel_class']} "
            f"| {t['tile_m']}, {t['tile_n']}, {t['dq_keys']} | {ex2} "
            f"| {', '.join(f['p_convert'])} / {', '.join(f['ds_convert'])} | {', '.join(f['out_convert']) or '-'} "
            f"| {f['reduce.targets']} | {f['tanh']} | {r['compiled']} |"
        )
    return "\n".join(L) + "\n"
