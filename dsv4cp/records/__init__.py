"""The measurement record shared by ``profile --out``, ``sweep``, ``report``, ``compare`` and the notebooks.

A run directory holds ``records.jsonl`` (one flat JSON object per measured point, columns
:data:`COLUMNS`) and ``meta.json`` (once per run: versions, hardware, the spec). This package is the
only place that defines the columns and their types (:data:`COLUMN_TYPES`, :data:`META_TYPES`), and
the only reader: every line is checked as it is read (:func:`check_record`; a bad one is named
``file:line: reason`` and skipped). It imports nothing but the standard library so every layer of the
package (and a notebook without torch) can use it.

Every line is strict JSON: a value that is not a finite number (a phase without communication has no
overlap ratio, ``nan``) is written as ``null``, which means "not measured or undefined" everywhere in a
record. JSON has no NaN or Infinity: Python writes them as bare ``NaN``, which ``jq``, JavaScript,
Go, Rust and most other strict parsers reject, so a file holding one could not be read by them at all.
Files written before hold bare ``NaN`` there; :func:`read_records` still reads them.

A value of the right type may still be one no measurement can hold (an imbalance below 1, a negative
peak, an MFU above 100%, a NaN throughput): :func:`impossible_values` names them and why; the loader
(``dsv4cp.report.load``) blanks them and reports them as invalid, so a report never shows or judges one.

The package by concern: :mod:`~dsv4cp.records.schema` (the columns, what they mean, their types;
:mod:`~dsv4cp.records.field_types` the types themselves), :mod:`~dsv4cp.records.ids` (a point's id),
:mod:`~dsv4cp.records.checks` (what a valid record is), :mod:`~dsv4cp.records.configuration` (how a point's
kernels ran, and the key records are paired on), :mod:`~dsv4cp.records.reading` and
:mod:`~dsv4cp.records.writing`. Every public name is imported from here, ``dsv4cp.records``.
"""

from __future__ import annotations

from dsv4cp.records.checks import (
    VALUE_RULES,
    check_meta,
    check_record,
    check_status,
    check_times,
    impossible_values,
)
from dsv4cp.records.configuration import (
    UNKNOWN,
    configuration_differences,
    configuration_key,
    option_differences,
    resolved_configuration,
    resolved_options,
)
from dsv4cp.records.field_types import (
    FLAG,
    INTS,
    INTS_OR_NULLS,
    MAPPING,
    NUMBER,
    NUMBERS,
    NUMBERS_OR_NULLS,
    OBJECTS,
    OBJECTS_OR_NULLS,
    SCALAR_MAPPING,
    TEXT,
    TEXT_MAPPING,
    FieldType,
)
from dsv4cp.records.ids import (
    ID_AXES,
    id_fragment,
    id_of_fragments,
    match_id,
    point_id,
)
from dsv4cp.records.reading import (
    RecordProblem,
    read_meta,
    read_records,
)
from dsv4cp.records.schema import (
    AXES,
    COLUMN_TYPES,
    COLUMNS,
    CONFIG_FIELDS,
    META_FIELDS,
    META_FILE,
    META_TYPES,
    METRICS,
    OK_REQUIRED_AXES,
    OK_TIMES,
    RECORDS_FILE,
    SCHEMA_VERSION,
    STATUS_OK,
    STATUS_OOM,
    STATUS_PREFIXES,
    before_the_physical_bound,
)
from dsv4cp.records.writing import (
    append_bytes,
    append_record,
    drop_partial_line,
    finite_or_null,
    make_record,
    move_records,
    replace_record,
    utc_now,
    write_file_atomically,
    write_meta,
)

__all__ = [
    "AXES",
    "COLUMNS",
    "COLUMN_TYPES",
    "CONFIG_FIELDS",
    "FLAG",
    "FieldType",
    "ID_AXES",
    "INTS",
    "INTS_OR_NULLS",
    "MAPPING",
    "META_FIELDS",
    "META_FILE",
    "META_TYPES",
    "METRICS",
    "NUMBER",
    "NUMBERS",
    "NUMBERS_OR_NULLS",
    "OBJECTS",
    "OBJECTS_OR_NULLS",
    "OK_REQUIRED_AXES",
    "OK_TIMES",
    "RECORDS_FILE",
    "RecordProblem",
    "SCALAR_MAPPING",
    "SCHEMA_VERSION",
    "STATUS_OK",
    "STATUS_OOM",
    "STATUS_PREFIXES",
    "TEXT",
    "TEXT_MAPPING",
    "UNKNOWN",
    "VALUE_RULES",
    "append_bytes",
    "append_record",
    "before_the_physical_bound",
    "check_meta",
    "check_record",
    "check_status",
    "check_times",
    "configuration_differences",
    "configuration_key",
    "drop_partial_line",
    "finite_or_null",
    "id_fragment",
    "id_of_fragments",
    "impossible_values",
    "make_record",
    "match_id",
    "move_records",
    "option_differences",
    "point_id",
    "read_meta",
    "read_records",
    "replace_record",
    "resolved_configuration",
    "resolved_options",
    "utc_now",
    "write_file_atomically",
    "write_meta",
]
