"""What the tests and the benchmarks both run against: installed with the package, so
a benchmark never imports ``tests`` or edits ``sys.path`` to reach it.

- ``configs``: SmolLM2, the tiny random-weight Llama on its tokenizer, and stage
  configs for them (``stage_config``, ``tiny_config``, ``write_config``).
- ``chat_prompts``: the 32 fixed chat prompts precision choices are judged on.
- ``engine_runs``: an engine run the way a stage runs it (``generate``,
  ``collect``, ``tokens_of``).
- ``fake_engine``, ``media_engine``: plug-in engines with nothing to load; a stage
  process loads ``services.testing.media_engine:MediaEngine`` by its import path.
- ``idle_flood``: idle HTTP/2 connections that hold a server's calls open.

Why here and not in ``benchmarks``: these describe the product (its stage configs,
its engine protocol, its wire), and tests and benchmarks are both its clients, as
``numpy.testing`` serves numpy's users; tests importing the benchmarks would turn
that around. Nothing of the product imports this package (pyproject: importlinter).
Helpers only the tests use stay in ``tests/helpers``.

Nothing is imported here, so ``idle_flood`` stays free of torch.
"""
