"""The `hf-tfm` commands, one module each, which `hf_tfm.cli` alone imports: `add_parser(subparsers)` (its options and
help), `run(args)` (its body; returns the exit status) and `DOC_PAGE`. `seq2seq` trains `--task seq2seq` for
`pretrain` and `finetune`; `training_options` holds what those three share, `common` what any command may use.
"""
