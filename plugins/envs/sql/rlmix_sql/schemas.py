"""Generated SQLite databases (three schemas, rows from a seeded generator) and question templates
paired with reference queries.

Every template picks its parameters from the database's own rows, so its reference query has a
non-empty, unambiguous answer: names are unique, salaries and prices are distinct (so "top k"
has no ties), and every department, category and course has rows pointing at it.
"""

from __future__ import annotations

import os
import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIRST = ("Ada", "Bruno", "Chloe", "Dmitri", "Esme", "Farid", "Greta", "Hugo", "Ines", "Jonas",
         "Keiko", "Luis", "Maya", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sven", "Tara",
         "Umar", "Vera", "Wen", "Yusuf", "Zoe")
LAST = ("Adams", "Berg", "Costa", "Diaz", "Evans", "Fischer", "Garcia", "Haddad", "Ito",
        "Jensen", "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Patel", "Rossi", "Silva")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Cairo", "Dublin")
COUNTRIES = ("Portugal", "Norway", "Kenya", "Peru", "Japan", "Canada", "Egypt", "Ireland")


@dataclass(frozen=True)
class Task:
    """One question about one database. ``ordered``: the question asks for an order, so the
    rows must come in the reference's order."""

    question: str
    sql: str
    ordered: bool = False


Rows = dict[str, list[tuple[Any, ...]]]
Template = Callable[[random.Random, Rows], Task]


def _people(rng: random.Random, n: int) -> list[str]:
    return rng.sample([f"{f} {sur}" for f in FIRST for sur in LAST], n)


def _q(text: str) -> str:
    """A string as an SQL literal."""
    return "'" + text.replace("'", "''") + "'"


# ---------------------------------------------------------------- company


COMPANY_DDL = (
    "CREATE TABLE departments (\n  id INTEGER PRIMARY KEY,\n  name TEXT NOT NULL,\n"
    "  city TEXT NOT NULL\n)",
    "CREATE TABLE employees (\n  id INTEGER PRIMARY KEY,\n  name TEXT NOT NULL,\n"
    "  department_id INTEGER NOT NULL REFERENCES departments(id),\n"
    "  salary INTEGER NOT NULL,\n  hire_year INTEGER NOT NULL\n)",
)


def company_rows(rng: random.Random) -> Rows:
    names = rng.sample(("Sales", "Engineering", "Marketing", "Finance", "Support", "Legal",
                        "Research"), rng.randint(3, 5))
    departments = [(i + 1, n, rng.choice(CITIES)) for i, n in enumerate(names)]
    n_emp = rng.randint(12, 24)
    salaries = rng.sample(range(30_000, 150_000, 500), n_emp)
    employees = []
    for i, (name, salary) in enumerate(zip(_people(rng, n_emp), salaries)):
        dept = i + 1 if i < len(departments) else rng.randint(1, len(departments))
        employees.append((i + 1, name, dept, salary, rng.randint(2010, 2024)))
    return {"departments": departments, "employees": employees}


def _c_count_in_dept(rng: random.Random, r: Rows) -> Task:
    d = rng.choice(r["departments"])[1]
    return Task(f"How many employees work in the {d} department?",
                "SELECT COUNT(*) FROM employees JOIN departments "
                f"ON employees.department_id = departments.id WHERE departments.name = {_q(d)}")


def _c_salary_above(rng: random.Random, r: Rows) -> Task:
    x = sorted(e[3] for e in r["employees"])[rng.randint(2, len(r["employees"]) - 3)]
    return Task(f"List the names of the employees whose salary is above {x}.",
                f"SELECT name FROM employees WHERE salary > {x}")


def _c_in_city(rng: random.Random, r: Rows) -> Task:
    c = rng.choice(r["departments"])[2]
    return Task(f"List the names of the employees who work in a department located in {c}.",
                "SELECT employees.name FROM employees JOIN departments "
                f"ON employees.department_id = departments.id WHERE departments.city = {_q(c)}")


def _c_per_dept(rng: random.Random, r: Rows) -> Task:
    return Task("For each department, give its name and its number of employees.",
                "SELECT departments.name, COUNT(*) FROM departments JOIN employees "
                "ON employees.department_id = departments.id GROUP BY departments.id")


def _c_avg_salary(rng: random.Random, r: Rows) -> Task:
    d = rng.choice(r["departments"])[1]
    return Task(f"What is the average salary of the employees in the {d} department?",
                "SELECT AVG(salary) FROM employees JOIN departments "
                f"ON employees.department_id = departments.id WHERE departments.name = {_q(d)}")


def _c_top_paid(rng: random.Random, r: Rows) -> Task:
    k = rng.randint(2, 5)
    return Task(f"List the names and salaries of the {k} highest-paid employees, from the "
                "highest salary down.",
                f"SELECT name, salary FROM employees ORDER BY salary DESC LIMIT {k}", True)


def _c_hired_between(rng: random.Random, r: Rows) -> Task:
    y1 = rng.randint(2010, 2020)
    y2 = rng.randint(y1 + 1, 2024)
    return Task(f"How many employees were hired between {y1} and {y2}, both years included?",
                f"SELECT COUNT(*) FROM employees WHERE hire_year BETWEEN {y1} AND {y2}")


# ---------------------------------------------------------------- shop


SHOP_DDL = (
    "CREATE TABLE customers (\n  id INTEGER PRIMARY KEY,\n  name TEXT NOT NULL,\n"
    "  country TEXT NOT NULL\n)",
    "CREATE TABLE products (\n  id INTEGER PRIMARY KEY,\n  name TEXT NOT NULL,\n"
    "  category TEXT NOT NULL,\n  price REAL NOT NULL\n)",
    "CREATE TABLE orders (\n  id INTEGER PRIMARY KEY,\n"
    "  customer_id INTEGER NOT NULL REFERENCES customers(id),\n"
    "  product_id INTEGER NOT NULL REFERENCES products(id),\n  quantity INTEGER NOT NULL,\n"
    "  order_year INTEGER NOT NULL\n)",
)
PRODUCTS = {"books": ("Atlas", "Novel", "Cookbook", "Dictionary", "Comic"),
            "garden": ("Rake", "Hose", "Shovel", "Planter", "Seeds"),
            "kitchen": ("Kettle", "Pan", "Whisk", "Teapot", "Grater"),
            "toys": ("Kite", "Puzzle", "Yo-yo", "Robot", "Ball")}


def shop_rows(rng: random.Random) -> Rows:
    customers = [(i + 1, n, rng.choice(COUNTRIES))
                 for i, n in enumerate(_people(rng, rng.randint(8, 14)))]
    products = []
    cents = rng.sample(range(199, 9999, 25), 20)
    for category, names in PRODUCTS.items():
        for name in rng.sample(names, 3):
            products.append((len(products) + 1, name, category, cents[len(products)] / 100))
    orders = []
    for i in range(rng.randint(20, 40)):
        # the first orders touch every product once, so each has orders
        product = i + 1 if i < len(products) else rng.randint(1, len(products))
        orders.append((i + 1, rng.randint(1, len(customers)), product, rng.randint(1, 5),
                       rng.randint(2019, 2024)))
    return {"customers": customers, "products": products, "orders": orders}


def _s_customers_from(rng: random.Random, r: Rows) -> Task:
    c = rng.choice(r["customers"])[2]
    return Task(f"How many customers are from {c}?",
                f"SELECT COUNT(*) FROM customers WHERE country = {_q(c)}")


def _s_cheap_in_category(rng: random.Random, r: Rows) -> Task:
    cat = rng.choice(sorted(PRODUCTS))
    prices = sorted(p[3] for p in r["products"] if p[2] == cat)
    limit = int(prices[-1]) + 1 if rng.random() < 0.3 else int(prices[1]) + 1
    return Task(f"List the names of the products in the {cat} category that cost less than "
                f"{limit}.",
                f"SELECT name FROM products WHERE category = {_q(cat)} AND price < {limit}")


def _s_total_quantity(rng: random.Random, r: Rows) -> Task:
    p = rng.choice(r["products"])[1]
    return Task(f"What is the total quantity ordered of the product {p}?",
                "SELECT SUM(orders.quantity) FROM orders JOIN products "
                f"ON orders.product_id = products.id WHERE products.name = {_q(p)}")


def _s_who_ordered(rng: random.Random, r: Rows) -> Task:
    p = rng.choice(r["products"])[1]
    return Task(f"List the names of the customers who ordered {p}, each name once.",
                "SELECT DISTINCT customers.name FROM customers "
                "JOIN orders ON orders.customer_id = customers.id "
                f"JOIN products ON orders.product_id = products.id WHERE products.name = {_q(p)}")


def _s_revenue_per_category(rng: random.Random, r: Rows) -> Task:
    return Task("For each product category, give the category and the total revenue "
                "(quantity times price) of its orders.",
                "SELECT products.category, SUM(orders.quantity * products.price) FROM orders "
                "JOIN products ON orders.product_id = products.id GROUP BY products.category")


def _s_most_expensive(rng: random.Random, r: Rows) -> Task:
    k = rng.randint(2, 5)
    return Task(f"List the names and prices of the {k} most expensive products, most expensive "
                "first.",
                f"SELECT name, price FROM products ORDER BY price DESC LIMIT {k}", True)


def _s_orders_in_year(rng: random.Random, r: Rows) -> Task:
    y = rng.choice(r["orders"])[4]
    return Task(f"How many orders were placed in {y}?",
                f"SELECT COUNT(*) FROM orders WHERE order_year = {y}")


# ---------------------------------------------------------------- school


SCHOOL_DDL = (
    "CREATE TABLE students (\n  id INTEGER PRIMARY KEY,\n  name TEXT NOT NULL,\n"
    "  year INTEGER NOT NULL\n)",
    "CREATE TABLE courses (\n  id INTEGER PRIMARY KEY,\n  title TEXT NOT NULL,\n"
    "  credits INTEGER NOT NULL\n)",
    "CREATE TABLE enrollments (\n  student_id INTEGER NOT NULL REFERENCES students(id),\n"
    "  course_id INTEGER NOT NULL REFERENCES courses(id),\n  grade INTEGER NOT NULL,\n"
    "  PRIMARY KEY (student_id, course_id)\n)",
)
COURSES = ("Algebra", "Biology", "Chemistry", "Drawing", "Economics", "French", "Geography",
           "History", "Music", "Physics")


def school_rows(rng: random.Random) -> Rows:
    students = [(i + 1, n, rng.randint(1, 4))
                for i, n in enumerate(_people(rng, rng.randint(10, 18)))]
    courses = [(i + 1, t, rng.choice((2, 3, 4, 5, 6)))
               for i, t in enumerate(rng.sample(COURSES, rng.randint(4, 7)))]
    pairs = {(s[0], courses[i % len(courses)][0]) for i, s in enumerate(students)}
    while len(pairs) < len(students) * 2:
        pairs.add((rng.choice(students)[0], rng.choice(courses)[0]))
    enrollments = [(s, c, rng.randint(40, 100)) for s, c in sorted(pairs)]
    return {"students": students, "courses": courses, "enrollments": enrollments}


def _k_in_year(rng: random.Random, r: Rows) -> Task:
    y = rng.choice(r["students"])[2]
    return Task(f"How many students are in year {y}?",
                f"SELECT COUNT(*) FROM students WHERE year = {y}")


def _k_enrolled(rng: random.Random, r: Rows) -> Task:
    c = rng.choice(r["courses"])[1]
    return Task(f"List the names of the students enrolled in {c}.",
                "SELECT students.name FROM students "
                "JOIN enrollments ON enrollments.student_id = students.id "
                f"JOIN courses ON enrollments.course_id = courses.id WHERE courses.title = {_q(c)}")


def _k_avg_grade(rng: random.Random, r: Rows) -> Task:
    c = rng.choice(r["courses"])[1]
    return Task(f"What is the average grade in {c}?",
                "SELECT AVG(enrollments.grade) FROM enrollments JOIN courses "
                f"ON enrollments.course_id = courses.id WHERE courses.title = {_q(c)}")


def _k_per_course(rng: random.Random, r: Rows) -> Task:
    return Task("For each course, give its title and the number of students enrolled in it.",
                "SELECT courses.title, COUNT(*) FROM courses JOIN enrollments "
                "ON enrollments.course_id = courses.id GROUP BY courses.id")


def _k_credits(rng: random.Random, r: Rows) -> Task:
    c = rng.choice(sorted({x[2] for x in r["courses"]})[:-1] or [1])
    return Task(f"List the titles of the courses worth more than {c} credits, in alphabetical "
                "order.",
                f"SELECT title FROM courses WHERE credits > {c} ORDER BY title", True)


def _k_high_grades(rng: random.Random, r: Rows) -> Task:
    g = rng.randint(70, 95)
    return Task(f"List the names of the students who got a grade of at least {g} in some "
                "course, each name once.",
                "SELECT DISTINCT students.name FROM students JOIN enrollments "
                f"ON enrollments.student_id = students.id WHERE enrollments.grade >= {g}")


@dataclass(frozen=True)
class Schema:
    name: str
    ddl: tuple[str, ...]
    rows: Callable[[random.Random], Rows]
    templates: tuple[Template, ...]


SCHEMAS: dict[str, Schema] = {
    "company": Schema("company", COMPANY_DDL, company_rows,
                      (_c_count_in_dept, _c_salary_above, _c_in_city, _c_per_dept,
                       _c_avg_salary, _c_top_paid, _c_hired_between)),
    "shop": Schema("shop", SHOP_DDL, shop_rows,
                   (_s_customers_from, _s_cheap_in_category, _s_total_quantity, _s_who_ordered,
                    _s_revenue_per_category, _s_most_expensive, _s_orders_in_year)),
    "school": Schema("school", SCHOOL_DDL, school_rows,
                     (_k_in_year, _k_enrolled, _k_avg_grade, _k_per_course, _k_credits,
                      _k_high_grades)),
}


@dataclass(frozen=True)
class Database:
    """A generated database file: ``key`` is ``<schema>-<seed>``. ``ddl`` holds the CREATE
    statements when they are not the schema's fixed ones (the generated tables of
    ``sql.difficulty: easy``), and ``spec`` what generated them."""

    key: str
    schema: str
    seed: int
    path: Path
    rows: Rows
    ddl: tuple[str, ...] = ()
    spec: Any = None

    @property
    def schema_sql(self) -> str:
        """The CREATE statements the prompt shows."""
        return ";\n\n".join(self.ddl or SCHEMAS[self.schema].ddl) + ";"


def build_database(schema: str, seed: int, folder: Path) -> Database:
    """Generate ``schema``'s rows from ``seed`` and write them to ``folder/<schema>-<seed>.db``."""
    spec = SCHEMAS[schema]
    rows = spec.rows(random.Random(f"sql-{schema}-{seed}"))
    return write_database(f"{schema}-{seed}", schema, seed, folder, spec.ddl, rows)


def write_database(key: str, schema: str, seed: int, folder: Path, ddl: tuple[str, ...],
                   rows: Rows, spec: Any = None) -> Database:
    """Write ``ddl`` and ``rows`` to ``folder/<key>.db`` (to a temporary name first, then
    renamed, so a crash never leaves half a database)."""
    path = folder / f"{key}.db"
    tmp = folder / f"{key}.db.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp)
    try:
        # no journal, no fsync: the file is private until the rename below
        conn.execute("PRAGMA journal_mode = OFF")
        conn.execute("PRAGMA synchronous = OFF")
        for statement in ddl:
            conn.execute(statement)
        for table, table_rows in rows.items():
            if table_rows:
                marks = ",".join("?" * len(table_rows[0]))
                conn.executemany(f"INSERT INTO {table} VALUES ({marks})", table_rows)
        conn.commit()
    finally:
        conn.close()
    os.replace(tmp, path)
    return Database(key, schema, seed, path, rows, ddl if spec is not None else (), spec)


def make_task(rng: random.Random, db: Database) -> Task:
    template = rng.choice(SCHEMAS[db.schema].templates)
    return template(rng, db.rows)
