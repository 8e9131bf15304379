"""GSM8K's rule reward as a verl custom reward function (``custom_reward_function.path``), used
unchanged by hybridrl's ``python`` reward: 1.0 when the response gives its final answer as
``#### <number>`` and that number is the ground truth, else 0.

Strict, as verl's GSM8K scorer is by default: a number anywhere else in the response does not
count, only one after ``####`` (the format the prompt asks for).
"""

import re

FINAL_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
TAIL = 300  # characters of the response searched: the answer comes last, and a long response is not scanned


def extract_final_answer(solution_str: str) -> str | None:
    """The number after the last ``####`` near the end of the response, without thousands
    separators; None when there is none."""
    found = FINAL_ANSWER.findall(solution_str[-TAIL:])
    return found[-1].replace(",", "") if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, score=1.0):
    """``score`` for the right final answer, ``format_score`` for a wrong one in the right format, 0 without one."""
    answer = extract_final_answer(solution_str)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth).replace(",", "") else format_score
