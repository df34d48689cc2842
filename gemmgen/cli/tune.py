"""`gemmgen tune`: where the tuning databases are, what they hold, and sharing them.

    gemmgen tune path                 the cache directory and this GPU's database file
    gemmgen tune show                 each database: GPU, versions, buckets, records
    gemmgen tune export FILE [--gpu SUBSTR]   all databases (or those of matching GPUs) in one file
    gemmgen tune import FILE [FILE ...]       merge into the cache, each into its GPU's database
"""
from __future__ import annotations

import argparse

from gemmgen import cache
from gemmgen.select import tuning_db
from gemmgen.errors import InputError


def cmd_path(args: argparse.Namespace) -> int:
    """Print the cache directory, and this GPU's database when a GPU is visible."""
    print(f"cache directory: {cache.cache_dir()}")
    print(f"tuning databases: {cache.cache_dir() / 'tuning'}")
    try:
        import torch

        if torch.cuda.is_available():
            from gemmgen.select import device

            facts = device.facts(torch.cuda.current_device())
            print(f"this GPU's database: {tuning_db.path_for(facts.fingerprint())}")
    except ImportError:
        pass
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print each database's device and contents in brief."""
    files = tuning_db.database_files()
    if not files:
        print(f"no tuning databases in {cache.cache_dir() / 'tuning'}")
        return 0
    for path in files:
        db = tuning_db.read_any(path)
        if db is None:  # reported and set aside
            continue
        dev = db.device
        print(f"{path}\n  {dev.get('gpu')} sm {dev.get('cc')}, driver {dev.get('driver')}, CUDA {dev.get('cuda')}, "
              f"gemmgen {dev.get('gemmgen_version')}: {db.count()} records")
        for fkey, bucket_map in sorted(db.entries.items()):
            print(f"  {fkey}: {len(bucket_map)} buckets")
            if args.verbose:
                for bkey, recs in sorted(bucket_map.items()):
                    timed = [tuning_db.Record.from_json(r) for r in recs.values()]
                    ok = [r for r in timed if r.ok]
                    best = min(ok, key=lambda r: r.ms) if ok else None
                    print(f"    {bkey}: {len(timed)} measured, best "
                          f"{f'{best.name} {best.ms:.4f} ms' if best else 'none'}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write the databases (matching --gpu) into one bundle file."""
    files = tuning_db.database_files()
    if args.gpu:
        dbs = {p: tuning_db.read_any(p) for p in files}
        files = [p for p, db in dbs.items() if db is not None and args.gpu.lower() in str(db.device.get("gpu")).lower()]
    if not files:
        raise InputError(f"no tuning databases{f' for GPUs matching {args.gpu!r}' if args.gpu else ''} in "
                         f"{cache.cache_dir() / 'tuning'}")
    count = tuning_db.export_bundle(files, args.file)
    print(f"exported {count} database{'s' * (count != 1)} to {args.file}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Merge bundles or database files into the cache."""
    for file in args.files:
        for target, records in tuning_db.import_file(file):
            print(f"{file}: merged {records} records into {target}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the chosen `gemmgen tune` sub-command."""
    return args.tune_func(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The sub-commands of `gemmgen tune`."""
    sub = p.add_subparsers(dest="tune_command", required=True, metavar="SUBCOMMAND")
    sub.add_parser("path", help="the cache directory and this GPU's database",
                   description="Print the cache directory and, where a GPU is visible, its tuning "
                               "database's file.").set_defaults(tune_func=cmd_path)
    show = sub.add_parser("show", help="what each database holds",
                          description="Print each tuning database's GPU, versions and record counts.")
    show.add_argument("-v", "--verbose", action="store_true", help="every bucket and its best instance")
    show.set_defaults(tune_func=cmd_show)
    exp = sub.add_parser("export", help="write the databases into one file to share",
                         description="Write every tuning database (or those of matching GPUs) into one "
                                     "file that `gemmgen tune import` reads.")
    exp.add_argument("file", help="the file to write")
    exp.add_argument("--gpu", help="only databases of GPUs whose name contains this")
    exp.set_defaults(tune_func=cmd_export)
    imp = sub.add_parser("import", help="merge exported files into the cache",
                         description="Merge exported bundles or database files into the cache, each "
                                     "into its GPU's database.")
    imp.add_argument("files", nargs="+", help="exported bundles or database files")
    imp.set_defaults(tune_func=cmd_import)
