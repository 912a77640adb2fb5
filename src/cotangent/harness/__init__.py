"""The training harness: models, data, training, records and the `cotangent` command.

Depends on the library (`cotangent`), numpy, tqdm and scipy; the library never imports it.
"""
