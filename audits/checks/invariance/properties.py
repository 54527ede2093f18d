"""The invariance properties by name, each with what it asserts: light, so that the command line
lists them without loading the checks."""

__all__ = ["ALL_PROPERTIES", "MOD_PROPERTIES", "PROPERTIES", "VARLEN_ONLY"]

#: the mod properties (``audits.checks.invariance.mods``), run when asked (``invariance --mods`` or ``--require``)
MOD_PROPERTIES = {
    "block_sparse": "a mask_mod dense == the same mask_mod block-sparse (bitwise where SM90 visits the same tiles in "
    "the same order, else within the forward bound)",
    "mask_flag": "causal / window flag == the causal / sliding_window mask_mod, softcap flag == the softcap "
    "score_mod (bitwise where SM90 computes the same arithmetic, else within the forward bound)",
}
PROPERTIES = {
    "batch": "a sequence alone == inside the batch, the batch reversed (and, varlen, beside shorter sequences)",
    "decode": "the last r query rows alone (q restricted, same KV) == those rows of the full call",
    "split": "num_splits 1 vs N (varlen): holds when both stay within the forward bound",
    "paged": "paged KV (page sizes 16..256) == contiguous KV, and page sizes against each other (varlen)",
    "pack_gqa": "pack_gqa on == off (varlen, GQA cases)",
}
VARLEN_ONLY = ("split", "paged", "pack_gqa")
#: every property: the five above, run by default, and the mod properties
#: (``audits.checks.invariance.mods``), run when asked (``invariance --mods`` or ``--require``)
ALL_PROPERTIES = {**PROPERTIES, **MOD_PROPERTIES}
