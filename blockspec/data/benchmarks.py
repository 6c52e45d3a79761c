"""How the evaluation sets ask their questions and where their test splits lie: one place for the
benchmark (which asks this way) and the trainer (which asks training prompts the same ways and must
never train on a test split)."""

REASONING_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                      "```python\n{prompt}\n```")
MBPP_TEST_IDS = range(11, 511)  # the MBPP test split: task_id 11..510
