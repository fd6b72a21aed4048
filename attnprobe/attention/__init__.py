"""How a loaded model's attention runs under attnprobe: the registered attention function, the
capture of chosen query rows, the sites editors rewrite (capture). Below the model room: loading a
model routes its attention here, and nothing here knows what a model is beyond its modules.
"""
