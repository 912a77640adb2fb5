"""The training harness: models, data, training, records and the `cotangent` command.

Depends on the library (`cotangent`), numpy and tqdm; the library never imports it.
"""
