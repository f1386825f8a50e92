"""Conversion between layouts and formats, offline: :mod:`.plan` decides what a conversion writes (TP split rules,
target layouts, key selection) from the source's metadata alone; :mod:`.export` does it (an oarlock checkpoint in
another layout, a HuggingFace directory, a DCP checkpoint), streaming tensor by tensor.
"""

from oarlock.checkpoint.convert.export import (convert_checkpoint, convert_to_dcp, export_hf, export_hf_sharded,
                                               iter_full_tensors, read_destination, single_threaded_copies)
from oarlock.checkpoint.convert.plan import (ConversionLayout, ConversionPlan, KeyPlan, ParallelLayout, SelectedKeys,
                                             TP_RULES, carried_objects, chunk_sizes, compile_program, plan_conversion,
                                             pp_stages, rank_descriptions, resolve_tp_rules, select_keys, side_files,
                                             strip_model_prefix, tp_axis)

__all__ = ['ConversionLayout', 'ConversionPlan', 'KeyPlan', 'ParallelLayout', 'SelectedKeys', 'TP_RULES',
           'carried_objects', 'chunk_sizes', 'compile_program', 'convert_checkpoint', 'convert_to_dcp', 'export_hf',
           'export_hf_sharded', 'iter_full_tensors', 'plan_conversion', 'pp_stages', 'rank_descriptions',
           'read_destination', 'resolve_tp_rules', 'select_keys', 'side_files', 'single_threaded_copies',
           'strip_model_prefix', 'tp_axis']
