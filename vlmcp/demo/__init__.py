"""`vlmcp demo`: the whole pipeline offline on CPU ranks, in a few minutes.

    assets.py  scikit-learn's digits as an image-question dataset (the `demo` extra)
    image.py   `vlmcp demo`: train the digits demo at SP 2, evaluate by generation, plot
    rl.py      `vlmcp demo --rl`: the online RL loop as a job of `vlmcp rl`
"""
