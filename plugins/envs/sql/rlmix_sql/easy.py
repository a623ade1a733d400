"""The easy end of ``sql.difficulty``: generated single-table databases and one-filter questions.

Each database is one table drawn from a seed: a domain (pets, books, cars, ...), a subset of its
columns and 8-14 random rows. Each question is a SELECT with exactly one filter (``=`` on a text
column, ``>`` / ``<`` on a number column, or the row with a given name), asking for the names,
a count, or one column. Parameters come from the table's own rows, so every reference query
answers something; names are unique, so "the pet named X" has one row.

The worked example that easy prompts show (:data:`EXAMPLE`) uses a table (``fruits``) that no
generated database has, so it never gives away a held-out answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from rlmix_sql.schemas import Database, Task, write_database

TEXT, INT = "TEXT", "INTEGER"


@dataclass(frozen=True)
class Domain:
    table: str  # plural, the table's name
    singular: str
    names: tuple[str, ...]  # the `name` column draws from these (unique per table)
    text: dict[str, tuple[str, ...]]  # text column -> its values
    numbers: dict[str, tuple[int, int]]  # integer column -> (low, high)


DOMAINS: tuple[Domain, ...] = (
    Domain("pets", "pet",
           ("Rex", "Milo", "Luna", "Bella", "Max", "Coco", "Daisy", "Oscar", "Nala", "Simba",
            "Pepper", "Ginger", "Rocky", "Toby", "Lola", "Zeus", "Misty", "Biscuit"),
           {"species": ("cat", "dog", "rabbit", "parrot"), "color": ("black", "white", "brown",
                                                                     "grey")},
           {"age": (1, 16), "weight": (2, 40)}),
    Domain("books", "book",
           ("Dune", "Emma", "Ulysses", "Beloved", "Rebecca", "Persuasion", "Walden", "Hamlet",
            "Ivanhoe", "Middlemarch", "Dracula", "Candide", "Lolita", "Siddhartha", "Matilda",
            "Heidi", "Kim", "Shogun"),
           {"genre": ("novel", "poetry", "history", "science"),
            "language": ("English", "French", "German", "Spanish")},
           {"pages": (90, 900), "year": (1800, 2020)}),
    Domain("cars", "car",
           ("Arrow", "Bolt", "Comet", "Dash", "Ember", "Falcon", "Glide", "Hornet", "Jet",
            "Kestrel", "Lynx", "Meteor", "Nova", "Orbit", "Puma", "Quasar", "Rover", "Swift"),
           {"brand": ("Fiat", "Volvo", "Toyota", "Ford"), "color": ("red", "blue", "silver",
                                                                    "black")},
           {"year": (2000, 2024), "price": (5000, 60000)}),
    Domain("players", "player",
           ("Aki", "Bea", "Cruz", "Dani", "Eero", "Fola", "Gus", "Hali", "Ira", "Jade", "Kai",
            "Lior", "Mina", "Noor", "Otto", "Pia", "Remy", "Sana"),
           {"team": ("Lions", "Hawks", "Bears", "Wolves"), "position": ("keeper", "defender",
                                                                        "forward")},
           {"goals": (0, 30), "age": (17, 38)}),
    Domain("movies", "movie",
           ("Alien", "Brazil", "Casablanca", "Fargo", "Gravity", "Heat", "Jaws", "Memento",
            "Psycho", "Rocky", "Seven", "Tron", "Up", "Vertigo", "Whiplash", "Yojimbo", "Zodiac",
            "Network"),
           {"genre": ("comedy", "drama", "horror", "action"), "country": ("USA", "France",
                                                                          "Japan", "Italy")},
           {"year": (1950, 2023), "minutes": (80, 190)}),
    Domain("cities", "city",
           ("Aveiro", "Bergen", "Cusco", "Delft", "Evora", "Fes", "Graz", "Hue", "Izmir",
            "Jena", "Kobe", "Leon", "Malmo", "Nantes", "Oulu", "Porto", "Quito", "Riga"),
           {"country": ("Portugal", "Norway", "Peru", "Spain"), "climate": ("dry", "wet",
                                                                           "cold")},
           {"population": (20, 900), "altitude": (0, 3000)}),
    Domain("songs", "song",
           ("Aurora", "Breathe", "Cascade", "Daydream", "Echo", "Firefly", "Gravity Falls",
            "Halo", "Island", "Jubilee", "Kaleidoscope", "Lullaby", "Monsoon", "Nightfall",
            "Oasis", "Paradise", "Quicksand", "Riptide"),
           {"genre": ("pop", "jazz", "rock", "folk"), "mood": ("happy", "sad", "calm")},
           {"seconds": (120, 420), "year": (1960, 2024)}),
    Domain("planets", "planet",
           ("Aldor", "Brisa", "Cyra", "Doran", "Elys", "Fenix", "Gaia", "Helio", "Ixion",
            "Juno", "Kepler", "Lumen", "Mira", "Nyx", "Orion", "Pax", "Rhea", "Sol"),
           {"kind": ("rocky", "gas", "ice"), "star": ("Vega", "Rigel", "Altair", "Deneb")},
           {"moons": (0, 20), "radius": (1000, 70000)}),
)


@dataclass(frozen=True)
class EasyTable:
    """One generated table: its domain, its columns ``(name, type)`` after ``id`` and ``name``,
    and its rows ``(id, name, *values)``."""

    domain: Domain
    columns: tuple[tuple[str, str], ...]
    rows: tuple[tuple[object, ...], ...]

    @property
    def ddl(self) -> str:
        cols = ["  id INTEGER PRIMARY KEY", "  name TEXT NOT NULL"]
        cols += [f"  {name} {kind} NOT NULL" for name, kind in self.columns]
        return f"CREATE TABLE {self.domain.table} (\n" + ",\n".join(cols) + "\n)"


def easy_table(seed: int) -> EasyTable:
    """The table of database ``seed``: a domain, 3 or 4 of its columns, 8-14 rows."""
    rng = random.Random(f"sql-easy-{seed}")
    domain = rng.choice(DOMAINS)
    pool = [(c, TEXT) for c in domain.text] + [(c, INT) for c in domain.numbers]
    chosen = set(rng.sample(pool, rng.randint(3, len(pool))))
    columns = tuple(c for c in pool if c in chosen)  # in the domain's order
    n = rng.randint(8, 14)
    rows = []
    for i, name in enumerate(rng.sample(domain.names, n)):
        values: list[object] = []
        for col, kind in columns:
            values.append(rng.choice(domain.text[col]) if kind == TEXT
                          else rng.randint(*domain.numbers[col]))
        rows.append((i + 1, name, *values))
    return EasyTable(domain, columns, tuple(rows))


def build_easy_database(seed: int, folder: Path) -> Database:
    """Write the table of ``seed`` to ``folder/easy-<seed>.db``."""
    table = easy_table(seed)
    rows = {table.domain.table: list(table.rows)}
    return write_database(f"easy-{seed}", "easy", seed, folder, (table.ddl,), rows, table)


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _column(table: EasyTable, rng: random.Random, kind: str) -> tuple[int, str] | None:
    """A random column of ``kind``, as (index in a row, name); None when there is none."""
    found = [(2 + i, c) for i, (c, k) in enumerate(table.columns) if k == kind]
    return rng.choice(found) if found else None


def make_easy_task(rng: random.Random, db: Database) -> Task:
    """One one-filter question about ``db``'s table, with its reference query."""
    table: EasyTable = db.spec
    t, one, rows = table.domain.table, table.domain.singular, table.rows
    while True:
        kind = rng.choice(("names_eq", "names_gt", "names_lt", "count_eq", "count_gt",
                           "value_of"))
        if kind in ("names_eq", "count_eq"):
            col = _column(table, rng, TEXT)
            if col is None:
                continue
            v = str(rng.choice(rows)[col[0]])
            if kind == "names_eq":
                return Task(f"List the names of the {t} whose {col[1]} is {v}.",
                            f"SELECT name FROM {t} WHERE {col[1]} = {_q(v)}")
            return Task(f"How many {t} have the {col[1]} {v}?",
                        f"SELECT COUNT(*) FROM {t} WHERE {col[1]} = {_q(v)}")
        if kind == "value_of":
            i, c = rng.choice([(2 + i, c) for i, (c, _) in enumerate(table.columns)])
            name = str(rng.choice(rows)[1])
            return Task(f"What is the {c} of the {one} named {name}?",
                        f"SELECT {c} FROM {t} WHERE name = {_q(name)}")
        col = _column(table, rng, INT)
        if col is None:
            continue
        values = sorted({int(r[col[0]]) for r in rows})  # type: ignore[call-overload]
        if len(values) < 2:
            continue
        if kind == "names_lt":  # never the smallest value: someone is below it
            x = rng.choice(values[1:])
            return Task(f"List the names of the {t} whose {col[1]} is less than {x}.",
                        f"SELECT name FROM {t} WHERE {col[1]} < {x}")
        x = rng.choice(values[:-1])  # never the largest value: someone is above it
        if kind == "names_gt":
            return Task(f"List the names of the {t} whose {col[1]} is greater than {x}.",
                        f"SELECT name FROM {t} WHERE {col[1]} > {x}")
        article = "an" if col[1][0] in "aeiou" else "a"
        return Task(f"How many {t} have {article} {col[1]} greater than {x}?",
                    f"SELECT COUNT(*) FROM {t} WHERE {col[1]} > {x}")


#: the worked example easy prompts show: a table no generated database has
EXAMPLE_DDL = ("CREATE TABLE fruits (\n  id INTEGER PRIMARY KEY,\n  name TEXT NOT NULL,\n"
               "  color TEXT NOT NULL,\n  price INTEGER NOT NULL\n);")
EXAMPLE = Task("List the names of the fruits whose color is red.",
               "SELECT name FROM fruits WHERE color = 'red';")
