"""``kvfuzz mutate``: the mutation score of kvfuzz on vLLM's cache-manager code.

* :mod:`differential.mutation.mutants` -- the code in scope, the mutants
  (cosmic-ray's operators) and the trees they run as.
* :mod:`differential.mutation.vllm_tests` -- vLLM's own tests as the peer
  score, on the same mutants (``--vllm-tests``).
* :mod:`differential.mutation.score` -- running the mutants next to stock
  vLLM on the corpus and a seeded campaign, the verdicts, the recorded runs
  and their report.

It sits above the campaign (it runs campaigns' scenarios on every mutant);
the package itself imports nothing.
"""
