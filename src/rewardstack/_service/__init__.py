"""The HTTP scoring service (`rewardstack serve`): one process owns the device; clients send steps.

`app` builds the FastAPI app, `worker` the thread that owns the models and every namespace's state,
`namespaces` the per-client state and tokens, `command` the CLI entry. The client side is
`rewardstack.client`. Needs the `rewardstack[service]` extra. See docs/SERVICE.md.
"""
