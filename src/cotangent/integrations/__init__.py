"""Optional integrations with training frameworks.

Each submodule imports its framework when it is imported itself (``import cotangent`` needs
torch alone): ``cotangent.integrations.hf`` (`CotangentTrainer`) needs
``pip install 'cotangent[hf]'``; ``cotangent.integrations.lightning`` (`CotangentClipping`) is
for ``pip install 'cotangent[lightning]'``.
"""
