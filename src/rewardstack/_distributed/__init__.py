"""Beyond one GPU on Ray: re-score archives of runs on an actor pool, serve many validators.

- `rewardstack rescore` (`rescore.rescore`): one run = one row of a Ray Data dataset, scored in
  order from fresh state by one actor of its pool; one parquet table per run.
- The Ray Serve deployment of the scoring service (`serve`): stateless replicas run the forward
  passes; each namespace's state lives in one named single-threaded actor that commits to shared
  storage.

Ray is an optional extra (`pip install 'rewardstack[ray]'`); importing this package does not import
it, and nothing outside this package imports Ray.
"""
