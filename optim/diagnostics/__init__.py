"""Diagnostics of an optimization step, as pure functions on parameter trees (any mesh, jit-able).

layers.py    per-layer statistics of params, grads and updates (split along the logical `layers` / `expert` axes)
spectra.py   the spectra of matrix parameters and updates (spectral norm, orthogonality error, quantiles, rank)
sharpness.py the Hessian's top eigenvalues by Hessian-vector products, the loss along an update, their overlap
noise.py     the gradient noise scale B_simple from gradients at two batch sizes (McCandlish et al. 2018)
"""
