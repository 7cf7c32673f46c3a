"""Weight formats for `Linear`: each is a `LinearMethod` that creates the layer's tensors,
loads checkpoint tensors into them and computes `x @ W^T` from them."""
