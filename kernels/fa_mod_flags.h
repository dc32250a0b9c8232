/*
 * The user-defined scoring switches of the sm80 families (forward and backward): the plan defines
 * FA_SCORE_MOD, FA_MASK_MOD and FA_BLOCK_MASK only for calls with mods, so the other kernels keep
 * their keys; 0 where absent.
 */
#ifndef FA_MOD_FLAGS_H
#define FA_MOD_FLAGS_H

#ifndef FA_SCORE_MOD
#define FA_SCORE_MOD 0
#endif
#ifndef FA_MASK_MOD
#define FA_MASK_MOD 0
#endif
#ifndef FA_BLOCK_MASK
#define FA_BLOCK_MASK 0
#endif
/* The Hopper forward decides its mask before score_mod runs (fa_mask_bits) where the plan asks
 * (FLASHATTN_SM90_MASK_FIRST=1, an A/B: slower by measurement). */
#ifndef FA_MOD_MASK_FIRST
#define FA_MOD_MASK_FIRST 0
#endif
/* The block mask's blocks are whole multiples of the kernel's tile (the sm90 forward's plan
 * defines FA_BM_ALIGNED), so no tile spans two of them and no key block is FA_BM_MIXED: the
 * per-key lookup is not compiled. */
#ifndef FA_BM_ALIGNED
#define FA_BM_ALIGNED 0
#endif
/* Keys can be dropped by more than the window: mask_mod or the block mask. */
#define FA_MOD_MASKS (FA_MASK_MOD || FA_BLOCK_MASK)

#endif /* FA_MOD_FLAGS_H */
