"""`vlmcp demo`: the whole pipeline offline on CPU ranks, in a few minutes.

    assets.py  scikit-learn's digits as an image-question dataset (the `demo` extra)
    image.py   `vlmcp demo`: train the digits demo at SP 2, evaluate by generation, plot
    rl.py      `vlmcp demo --rl`: an online RL loop, the trainer and its orchestrator
    orchestrator.py  the RL demo's orchestrator: sampling, rewards, rollout steps
"""
