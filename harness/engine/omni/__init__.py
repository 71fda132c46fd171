"""vLLM-Omni as an engine backend: its LingBot-World modules run inside the harness's workers.

Nothing here imports vLLM unless the ``vllm-omni`` backend is chosen (or an equivalence test runs):
``vllm`` and ``vllm_omni`` take 30-60 s to import and are an optional extra (``pip install -e
'.[vllm]'``). ``compat`` is the one place that knows the installed version's quirks; its install
check is stdlib only, so ``engine.backends`` imports it with the command line.
"""
