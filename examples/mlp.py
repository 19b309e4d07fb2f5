"""A 4-layer MLP, the seeds' Y = ReLU(Linear(X, W, b)) stacked: `tapestry run examples/mlp.py --nproc 4 --verify`."""
from tapestry.models import mlp

graph = mlp(depth=4, batch=512, width=256)
