"""STAND-IN for the FreeToken inference engine 0.2.x (no GPU, no model execution).

Imitates what a deployment can observe of the real engine: the command line of
`python -m freetoken` / `ft serve` (freetoken/server/args.py mirrors the real parser), the
model checks at start (quantisation dialects, the `NotImplementedError: no quant method for
moe.fp8_tensor` failure, missing shards), the log lines, the early-bound `/health` with its
loading/ok/error JSON, the 503 gate while loading, API-key auth, the OpenAI-style routes with
tokens paced at a configured rate, the gloo listener on port+1, and failure modes (backend
death -> health error -> exit by SIGTERM ~10 s later; worker crash; CUDA OOM log line).
See freetoken/standin.py for the server and its configuration.
"""

from .version import __version__

__all__ = ["__version__"]
