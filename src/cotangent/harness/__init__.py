"""The training harness: models, data, training, records and the `cotangent` command.

Depends on the library (`cotangent`), numpy, tqdm, scipy and matplotlib (the `harness` extra;
`entry`, the command's entry point, imports only the standard library until those are found);
the library never imports it.
"""
