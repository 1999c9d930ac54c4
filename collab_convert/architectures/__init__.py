"""Architecture knowledge, in one place.

families  every model family as data: model types, where attention sits, its layout, its forward if it needs one
layouts   the ONE reader of a query/key layout: find layers, read Q/K (grouped keys too), output specs, module
          surgery, calibration hook points
naming    checkpoint names as the loaded model sees them (transformers' own renamings)
source    a source checkpoint opened for compression
"""
