/* Paged K/V in the varlen forward on the GPU (gpu_paged.c); returns the number of failures. */
#ifndef GPU_PAGED_H
#define GPU_PAGED_H

int gpu_paged_checks(void);

#endif /* GPU_PAGED_H */
