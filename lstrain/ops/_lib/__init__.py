"""Pieces the fused ops share: the custom-op helper, autocast, first-order autograd
guards, row layouts, partial sums, activations and Philox dropout. Private: the public
ops live one per module in :mod:`lstrain.ops`."""
