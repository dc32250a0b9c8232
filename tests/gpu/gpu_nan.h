/* NaN and Inf cases of the GPU tests (gpu_nan.c): the forward, and with backward != 0 the
 * backward too, on the plan the environment selects; returns the number of failures. */
#ifndef GPU_NAN_H
#define GPU_NAN_H

int gpu_nan_checks(int backward);

#endif /* GPU_NAN_H */
