"""50 structured-output tasks for benchmarks/structured_qwen.py: a prompt and its own JSON schema each.

Written for this benchmark (realistic extraction / generation requests: objects with required fields, enums,
arrays, integers and numbers with bounds, booleans, nested objects). Strings and arrays carry maxLength /
maxItems so that every valid answer fits the benchmark's max_tokens; `additionalProperties: false` everywhere so
the grammar (and jsonschema) pin the keys.
"""
from __future__ import annotations


def S(n: int = 40, m: int = 1) -> dict:
    return {"type": "string", "minLength": m, "maxLength": n}


def I(lo: int, hi: int) -> dict:  # noqa: E743 - a short name keeps the table readable
    return {"type": "integer", "minimum": lo, "maximum": hi}


def N(lo: float, hi: float) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi}


def E(*values) -> dict:
    return {"enum": list(values)}


B = {"type": "boolean"}


def A(items: dict, hi: int = 3, lo: int = 1) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def O(**props) -> dict:  # noqa: E743
    """An object whose every property is required, in this order, nothing else allowed."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def O_opt(required: list[str], **props) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


TASKS: list[tuple[str, dict]] = [
    ("Extract the product listing as JSON: 'Acme X200 cordless drill, 18V, $89.99, in stock, rated 4.6 by 212 "
     "buyers, category power tools.'",
     O(name=S(), price_usd=N(0, 10000), in_stock=B, rating=N(0, 5), reviews=I(0, 100000),
       category=E("power tools", "hand tools", "garden", "kitchen", "other"))),
    ("Give today's weather for Lisbon as JSON: condition, temperature in Celsius, humidity percent, wind.",
     O(city=S(30), condition=E("sunny", "cloudy", "rain", "snow", "storm", "fog"), temperature_c=I(-40, 50),
       humidity_pct=I(0, 100), wind=O(speed_kmh=I(0, 200), direction=E("N", "NE", "E", "SE", "S", "SW", "W", "NW")))),
    ("Write a short recipe for pancakes as JSON with title, servings, difficulty and up to 4 ingredients.",
     O(title=S(), servings=I(1, 12), difficulty=E("easy", "medium", "hard"),
       ingredients=A(O(item=S(24), grams=I(1, 2000)), 4))),
    ("Return bibliographic data for the novel 'Dune' by Frank Herbert (1965) as JSON.",
     O(title=S(), author=S(), year=I(1000, 2030), genres=A(S(20), 3), isbn_known=B)),
    ("Rate the movie 'Inception' as a short JSON review.",
     O(movie=S(), score=I(1, 10), verdict=E("must see", "worth it", "skip"), summary=S(80, 10), spoilers=B)),
    ("Book a flight from Paris to Tokyo for two adults in economy on 2025-04-12; answer with the booking request "
     "as JSON.",
     O(origin=S(3, 3), destination=S(3, 3), date=S(10, 10), passengers=O(adults=I(1, 9), children=I(0, 9)),
       cabin=E("economy", "premium", "business", "first"))),
    ("File a bug report as JSON: the login page crashes on Safari when the password has an emoji.",
     O(title=S(60), severity=E("low", "medium", "high", "critical"), component=E("frontend", "backend", "auth", "db"),
       steps=A(S(50), 4), reproducible=B)),
    ("Produce a JSON invoice for 3 hours of consulting at $120/hour for client Initech, invoice number 1042.",
     O(invoice_number=I(1, 999999), client=S(), lines=A(O(description=S(40), quantity=I(1, 100), unit_price=N(0, 5000)), 3),
       currency=E("USD", "EUR", "GBP"), paid=B)),
    ("Create a user profile JSON for a new account: username, age, preferred language and notification settings.",
     O(username=S(20, 3), age=I(13, 120), language=E("en", "fr", "de", "es", "ja", "pt"),
       notifications=O(email=B, sms=B, push=B))),
    ("Describe an upcoming tech meetup as JSON: name, city, date, capacity, whether it is free, and up to 3 topics.",
     O(name=S(), city=S(30), date=S(10, 10), capacity=I(1, 5000), free=B, topics=A(S(30), 3))),
    ("Turn this job ad into JSON: 'Senior Python developer, remote, full-time, 5+ years, salary 90-120k EUR.'",
     O(title=S(), remote=B, employment=E("full-time", "part-time", "contract", "internship"), min_years=I(0, 30),
       salary=O(min=I(0, 1000000), max=I(0, 1000000), currency=E("EUR", "USD", "GBP")))),
    ("Give a JSON entry for an Italian restaurant in a city guide: name, cuisine, price level, rating, open late.",
     O(name=S(), cuisine=E("italian", "french", "japanese", "mexican", "indian", "other"), price_level=I(1, 4),
       rating=N(0, 5), open_late=B, signature_dishes=A(S(30), 3))),
    ("Write a hotel reservation as JSON: guest name, check-in and check-out dates, room type, nights, breakfast.",
     O(guest=S(), check_in=S(10, 10), check_out=S(10, 10), room=E("single", "double", "suite"), nights=I(1, 60),
       breakfast=B)),
    ("Schedule a dentist appointment as JSON for patient Maria Lopez next Tuesday at 10:30.",
     O(patient=S(), clinic=E("dental", "general", "eye", "skin"), day=E("monday", "tuesday", "wednesday", "thursday",
                                                                      "friday"),
       time=S(5, 5), duration_min=I(10, 180), first_visit=B)),
    ("Describe a used car for sale as JSON: make, model, year, mileage in km, fuel and price.",
     O(make=S(20), model=S(20), year=I(1950, 2026), mileage_km=I(0, 1000000), fuel=E("petrol", "diesel", "hybrid",
                                                                                      "electric"),
       price_eur=I(0, 500000))),
    ("Summarise a git commit that fixes a null pointer in the parser as JSON (type, scope, subject, files).",
     O(type=E("feat", "fix", "docs", "refactor", "test", "chore"), scope=S(20), subject=S(60, 5),
       files=A(S(40), 3), breaking=B)),
    ("Document a REST endpoint that returns a user by id as JSON.",
     O(method=E("GET", "POST", "PUT", "PATCH", "DELETE"), path=S(40), auth_required=B,
       params=A(O(name=S(20), type=E("string", "integer", "boolean"), required=B), 3),
       responses=A(I(100, 599), 4))),
    ("Report the final score of a football match between Arsenal and Chelsea as JSON.",
     O(home=S(30), away=S(30), home_goals=I(0, 20), away_goals=I(0, 20), competition=E("league", "cup", "friendly"),
       extra_time=B)),
    ("Give a stock quote for ACME Corp as JSON: ticker, price, change percent, volume, market open.",
     O(ticker=S(5, 1), price=N(0, 100000), change_pct=N(-100, 100), volume=I(0, 10 ** 12), market_open=B)),
    ("Describe a university course on databases as JSON: code, title, credits, level, prerequisites.",
     O(code=S(10, 3), title=S(), credits=I(1, 12), level=E("undergraduate", "graduate"), prerequisites=A(S(10), 3, 0),
       online=B)),
    ("Track a parcel as JSON: tracking number, carrier, status and up to 3 recent scan events.",
     O(tracking_number=S(24, 6), carrier=E("UPS", "FedEx", "DHL", "USPS", "other"),
       status=E("label created", "in transit", "out for delivery", "delivered", "exception"),
       events=A(O(location=S(30), day=I(1, 31)), 3))),
    ("List a dog available for adoption as JSON: name, breed, age in months, size, vaccinated, good with kids.",
     O(name=S(20), breed=S(30), age_months=I(0, 240), size=E("small", "medium", "large"), vaccinated=B,
       good_with_kids=B)),
    ("Describe an apartment listing as JSON: city, rooms, area in square meters, monthly rent, features.",
     O(city=S(30), rooms=I(1, 10), area_m2=I(10, 1000), rent_eur=I(100, 20000), furnished=B,
       features=A(E("balcony", "elevator", "parking", "garden", "dishwasher"), 3))),
    ("Describe the album 'Abbey Road' as JSON: artist, year, number of tracks and up to 3 track names.",
     O(album=S(), artist=S(), year=I(1900, 2030), track_count=I(1, 50), tracks=A(S(30), 3))),
    ("Propose a 30-minute conference talk about speculative decoding as JSON.",
     O(title=S(70), speaker=S(30), duration_min=I(5, 120), level=E("beginner", "intermediate", "advanced"),
       tags=A(S(20), 3), needs_projector=B)),
    ("Open a customer support ticket as JSON: the customer was charged twice for order 5531.",
     O(order_id=I(1, 10 ** 7), category=E("billing", "shipping", "technical", "account"),
       priority=E("low", "normal", "urgent"), summary=S(80, 10), refund_requested=B)),
    ("Report the status of three web servers as JSON.",
     O(checked_at=S(20), servers=A(O(host=S(30), up=B, cpu_pct=I(0, 100), latency_ms=I(0, 10000)), 3, 3))),
    ("Create a fantasy game character as JSON: name, class, level, stats and an inventory.",
     O(name=S(24), character_class=E("warrior", "mage", "rogue", "cleric", "ranger"), level=I(1, 100),
       stats=O(strength=I(1, 20), dexterity=I(1, 20), intelligence=I(1, 20)), inventory=A(S(24), 4))),
    ("Give the shopping cart of an online grocery order as JSON with up to 4 items and a delivery slot.",
     O(items=A(O(sku=S(12, 3), qty=I(1, 50)), 4), delivery_slot=E("morning", "afternoon", "evening"),
       express=B, coupon=S(12, 0))),
    ("Write an employee record as JSON: id, full name, department, manager id, start year, full time.",
     O(employee_id=I(1, 999999), full_name=S(), department=E("engineering", "sales", "marketing", "finance", "hr"),
       manager_id=I(0, 999999), start_year=I(1970, 2026), full_time=B)),
    ("Record a library loan as JSON: member, book title, loan days, renewals, overdue.",
     O(member_id=I(1, 10 ** 6), book=S(50), loan_days=I(1, 90), renewals=I(0, 5), overdue=B)),
    ("Plan a 3-day trip to Rome as JSON: one activity per day, budget and transport.",
     O(destination=S(30), days=A(O(day=I(1, 14), activity=S(40)), 3, 3), budget_eur=I(0, 100000),
       transport=E("plane", "train", "car", "bus"))),
    ("Encode a customer satisfaction survey response as JSON: scores 1-5 and a comment.",
     O(respondent_id=I(1, 10 ** 6), overall=I(1, 5), support=I(1, 5), would_recommend=B, comment=S(80, 0))),
    ("Describe a bank card transaction at a coffee shop as JSON: amount, currency, merchant, category, pending.",
     O(amount=N(0, 100000), currency=E("USD", "EUR", "GBP", "JPY"), merchant=S(40),
       category=E("food", "travel", "shopping", "bills", "other"), pending=B)),
    ("Log a gym workout as JSON: type, duration, calories and up to 3 exercises with sets and reps.",
     O(workout=E("strength", "cardio", "mobility"), duration_min=I(1, 300), calories=I(0, 3000),
       exercises=A(O(name=S(24), sets=I(1, 10), reps=I(1, 50)), 3))),
    ("Give care instructions for a monstera plant as JSON: light, watering interval in days, pet safe.",
     O(plant=S(30), light=E("low", "medium", "bright indirect", "full sun"), water_every_days=I(1, 60),
       humidity=E("low", "medium", "high"), pet_safe=B)),
    ("Create a calendar reminder as JSON: title, date, time, repeat, minutes before to notify.",
     O(title=S(50), date=S(10, 10), time=S(5, 5), repeat=E("none", "daily", "weekly", "monthly"),
       notify_minutes_before=I(0, 1440))),
    ("Classify this email as JSON: 'Congratulations! You won a free cruise, click here to claim your prize now!'",
     O(label=E("spam", "promotion", "personal", "work", "phishing"), confidence=N(0, 1), contains_link=B,
       reasons=A(S(50), 3))),
    ("Analyse the sentiment of the review 'The battery dies in two hours, but the screen is gorgeous.' as JSON.",
     O(sentiment=E("positive", "negative", "mixed", "neutral"), score=N(-1, 1),
       aspects=A(O(aspect=S(20), polarity=E("positive", "negative", "neutral")), 3))),
    ("Translate 'Where is the train station?' into French and Spanish; answer as JSON.",
     O(source=S(60), translations=A(O(lang=E("fr", "es", "de", "it"), text=S(60)), 2, 2), formal=B)),
    ("Write a code review comment as JSON about an unchecked array index in utils.c line 88.",
     O(file=S(40), line=I(1, 100000), severity=E("nit", "suggestion", "issue", "blocker"), comment=S(90, 10),
       resolved=B)),
    ("Write a package manifest as JSON for a small Python CLI tool with 2 dependencies.",
     O(name=S(30), version=S(12, 5), license=E("MIT", "Apache-2.0", "BSD-3-Clause", "GPL-3.0"),
       dependencies=A(O(package=S(24), min_version=S(12, 1)), 2, 2), python_requires=S(10))),
    ("Report the result of a CI pipeline run as JSON: id, branch, status, duration and failed jobs.",
     O(run_id=I(1, 10 ** 9), branch=S(40), status=E("success", "failure", "cancelled"), duration_s=I(0, 86400),
       failed_jobs=A(S(30), 3, 0))),
    ("Describe a SQL table for blog posts as JSON: table name and up to 4 columns with types.",
     O(table=S(30), columns=A(O(name=S(24), type=E("INTEGER", "TEXT", "BOOLEAN", "TIMESTAMP", "REAL"), nullable=B), 4),
       primary_key=S(24))),
    ("Describe a network switch in the inventory as JSON: hostname, vendor, port count, firmware, managed.",
     O(hostname=S(30), vendor=E("cisco", "juniper", "aruba", "netgear", "other"), ports=I(4, 96), firmware=S(16),
       managed=B, vlans=A(I(1, 4094), 3))),
    ("Give a citation of the paper 'Attention Is All You Need' as JSON.",
     O(title=S(80), first_author=S(40), year=I(1900, 2030), venue=S(40), citations_known=B)),
    ("Describe a podcast episode as JSON: show, episode number, title, length in minutes, guests, explicit.",
     O(show=S(40), episode=I(1, 10000), title=S(60), minutes=I(1, 400), guests=A(S(30), 2, 0), explicit=B)),
    ("Write a museum exhibit label as JSON: artwork, artist, year, medium and room.",
     O(artwork=S(50), artist=S(40), year=I(-3000, 2026), medium=E("oil", "watercolor", "sculpture", "photo", "mixed"),
       room=I(1, 200), on_loan=B)),
    ("Give nutrition facts per 100 g of oatmeal as JSON: calories, protein, carbs, fat, fiber, gluten free.",
     O(food=S(30), calories=I(0, 1000), protein_g=N(0, 100), carbs_g=N(0, 100), fat_g=N(0, 100),
       gluten_free=B)),
    ("Report the status of flight LH 400 as JSON: airline, flight number, status, delay, gate.",
     O_opt(["airline", "flight", "status", "delay_min"], airline=S(30), flight=S(8, 3),
           status=E("scheduled", "boarding", "departed", "delayed", "cancelled", "landed"), delay_min=I(0, 1440),
           gate=S(4, 1))),
]
assert len(TASKS) == 50, len(TASKS)
