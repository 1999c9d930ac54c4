"""The math of collaborative attention. Imports torch only (TensorLy lazily, for the reference method).

products   the stacked per-head products T[i] = W_Q^(i)^T W_K^(i) and their collaborative factors, factored
spectra    singular values of the layer's views, energy ranks (the PCA redundancy analysis)
tucker     HOSVD subspaces: compress to the shared subspace
als        CP-ALS on the factored Tucker core (ours)
calibrated whitened fits: the logit error on real inputs
reference  the paper's dense TensorLy parafac, for comparison
refinement recovery against the original attention distributions
costs      parameter, FLOP and key-cache arithmetic
methods    method name -> fit: the one place a decomposition method is registered
"""
