"""Twenty code-completion prompts written for forerun's CPU benchmark (plain-text instructions; the chat
template of the instruct models wraps them)."""

CODE_PROMPTS = (
    "Write a Python function `is_prime(n)` that returns True when n is a prime number.",
    "Write a Python function that reverses a singly linked list and returns the new head.",
    "Implement binary search over a sorted Python list; return the index or -1.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    "Write a Python function that counts the words in a text file and returns a dict of counts.",
    "Write a JavaScript function that debounces another function by a given number of milliseconds.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
    "Write a Python function `fib(n)` that returns the n-th Fibonacci number iteratively.",
    "Write a C function that computes the length of a null-terminated string without strlen.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a bash script that prints the five largest files in the current directory.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python dataclass `Point` with x and y fields and a method `distance_to(other)`.",
    "Write a Rust function that returns the maximum value in a slice of i32, or None when empty.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a Python function that parses a CSV line with quoted fields into a list of strings.",
    "Write a Go function that reverses a string that may contain Unicode characters.",
    "Write a Python generator that yields the prime numbers below n with the sieve of Eratosthenes.",
    "Write a Python function that returns the most common element in a list.",
    "Write a Python unittest test case for a function `add(a, b)` that adds two numbers.",
)
