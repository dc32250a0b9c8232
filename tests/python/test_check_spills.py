"""tools/check_spills.py's SASS counts: local memory, and wgmmas that ptxas serialised (each
HGMMA waited for before the next), which the precompile's log check does not see in the
backward's split compiles. SASS text in cuobjdump's layout, with random filler instructions."""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import check_spills  # noqa: E402

FILLER = ["IMAD R2, R3, R4, RZ", "UIADD3.64 UR16, UR8, 0x4, URZ", "FFMA R5, R6, R7, R8",
          "MOV R9, R10", "@P0 BRA 0x1f60"]


def sass_text(name, body, rng):
    """cuobjdump --dump-sass's form: a Function line, then one instruction per line (address,
    instruction, encoding) with its second encoding line, random filler between."""
    lines = [f"\t\tFunction : {name}"]
    addr = 0
    for ins in body:
        for extra in rng.sample(FILLER, rng.randint(0, 2)) + [ins]:
            lines.append(f"        /*{addr:04x}*/                   {extra} ;"
                         f"                     /* 0x0000000000007948 */")
            lines.append(" " * 108 + "/* 0x000fe40000010000 */")
            addr += 16
    return "\n".join(lines) + "\n"


def counts(text):
    stats = {}
    check_spills.sass_stats(text, stats)
    return stats


def test_serialised_wgmmas_flagged():
    rng = random.Random()
    n = rng.randint(4, 12)
    body = []
    for _ in range(n):
        body += ["WARPGROUP.ARRIVE", "HGMMA.64x32x16.F32.BF16 R200, gdesc[UR16], R200, gsb0",
                 "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    s = counts(sass_text("fa_bwd", body, rng))["fa_bwd"]
    assert s[6] == n and s[7] == n
    assert check_spills.serial(s)


def test_pipelined_groups_pass():
    rng = random.Random()
    groups = rng.randint(2, 5)
    body = []
    for g in range(groups):
        body.append("WARPGROUP.ARRIVE")
        body += ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0"] * rng.randint(2, 6)
        # odd groups: a wait that leaves one group in flight, later the wait for all (after no
        # HGMMA: not a serialised one); even groups: the wait for all at once
        if g % 2:
            body += ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
        else:
            body.append("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    s = counts(sass_text("fa_fwd", body, rng))["fa_fwd"]
    assert s[6] >= 2 * groups
    assert s[7] == (groups + 1) // 2  # the last HGMMA of each group waited for with 0x0
    assert not check_spills.serial(s)


def test_local_memory_and_functions_apart():
    rng = random.Random()
    ldl, stl = rng.randint(1, 5), rng.randint(1, 5)
    spill = ["LDL R1, [R1+0x10]"] * ldl + ["STL [R1+0x8], R2"] * stl
    text = sass_text("fa_a", spill, rng) + sass_text("fa_b", ["MOV R1, R2"], rng)
    st = counts(text)
    assert st["fa_a"][2:4] == [ldl, stl]
    assert st["fa_b"][2:4] == [0, 0] and st["fa_b"][6:8] == [0, 0]
    assert st["fa_a"][5] != st["fa_b"][5]  # digests of different code
