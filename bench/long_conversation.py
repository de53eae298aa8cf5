"""A ~4k-token version of bench/conversation.py's chat, for benchmarks that need long histories.

The same assistant, with the cooperative's handbook attached to its system prompt (bed-by-bed
records, the volunteer list, the tool shed, the budget so far: what a deployment pastes in as
reference notes), and sixteen user turns: the eight of bench/conversation.py, then eight
follow-ups in other words. With 48-token replies the 16th turn's prompt is about 4k tokens on
SmolLM2's tokenizer (a bit fewer on Gemma's larger vocabulary).
"""

from __future__ import annotations

from bench.conversation import SYSTEM_PROMPT, USER_TURNS

_CROPS = ["broad beans", "chard", "lettuce", "onions", "garlic", "carrots", "beetroot", "courgettes",
          "squash", "potatoes", "peas", "leeks", "kale", "spinach", "radishes", "calendula"]
_NAMES = ["Mira", "Jonas", "Aylin", "Pedro", "Hanna", "Kofi", "Lea", "Tomasz", "Sofia", "Ravi",
          "Ines", "Malte", "Yuki", "Amara", "Felix"]
_SKILLS = ["beekeeping", "carpentry", "seed saving", "composting", "pruning", "first aid", "irrigation",
           "children's workshops", "accounts", "grafting", "greenhouse care", "tool repair",
           "photography", "translation", "festival planning"]


def _beds() -> list[str]:
    lines = []
    for garden, count in (("North", 12), ("River", 6), ("Hill", 8)):
        for bed in range(1, count + 1):
            i = len(lines)
            last, now = _CROPS[i % len(_CROPS)], _CROPS[(i * 5 + 3) % len(_CROPS)]
            note = ("tomato blight two summers ago, no tomatoes" if garden == "North" and bed in (3, 4) else
                    "floods in early spring" if garden == "River" else
                    "exposed to the west wind" if garden == "Hill" and bed > 4 else "no problems noted")
            lines.append(f"- {garden} bed {bed}: last year {last}, planned this year {now}; "
                         f"compost added in {['October', 'November', 'March'][i % 3]}; {note}.")
    return lines


def _volunteers() -> list[str]:
    return [f"- {name}: {['Tuesday evenings', 'Saturday mornings', 'both sessions'][i % 3]}, "
            f"mostly at the {['North', 'River', 'Hill'][i % 3]} garden, good at {_SKILLS[i]}"
            f"{', new this year' if i % 3 == 1 else ''}." for i, name in enumerate(_NAMES)]


def _calendar() -> list[str]:
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
              "October", "November", "December"]
    return [f"- {month}: sow {_CROPS[i % len(_CROPS)]} and {_CROPS[(i + 7) % len(_CROPS)]} "
            f"({['under cover', 'outdoors', 'in the River greenhouse'][i % 3]}), harvest "
            f"{_CROPS[(i + 11) % len(_CROPS)]}; {['mulch', 'weed', 'turn the compost', 'check the nets'][i % 4]} "
            f"on the first Saturday." for i, month in enumerate(months)]


HANDBOOK = "\n".join([
    "Bed records (kept by the coordinators):", *_beds(), "",
    "Active volunteers:", *_volunteers(), "",
    "Tool shed (North garden): 9 spades, 7 forks, 14 hand trowels, 4 hoes, 3 rakes, 2 wheelbarrows "
    "(one with a slow puncture), 1 stepladder (checked in March), 6 watering cans, 2 hoses of 25 "
    "metres, 40 metres of bean netting, 12 bamboo canes per bed, a first-aid kit restocked in February.",
    "Budget so far this year: seeds 310 euros, compost delivery 180 euros, repair of the River "
    "greenhouse door 95 euros, new hoses 70 euros, festival deposit for the tent 150 euros; "
    "1595 euros remain of the 2400.",
    "", "Sowing calendar agreed at the February assembly:", *_calendar(), "",
    "Notes from the last Saturdays:",
    "- North: beds 1, 2 and 5 dug over and mulched; the rainwater tank is at two thirds; a fox "
    "dug in the compost bay twice, so the lid now stays weighted with a paving stone.",
    "- River: the greenhouse door sticks in wet weather; lettuce seedlings pricked out into "
    "modules; the slug traps caught about forty slugs a night in the first week.",
    "- Hill: Mira reports the hive is strong and foraging on the willow by the fence; two new "
    "beds marked out with string; the west fence needs three new posts before summer.",
    "",
    "Assembly decisions: the second rainwater tank was discussed in March and postponed until a "
    "costed note is presented; the festival committee is Sofia, Pedro and Amara; tools leave the "
    "shed only with a name in the notebook.",
])

LONG_SYSTEM_PROMPT = SYSTEM_PROMPT + "\nThe cooperative's handbook:\n" + HANDBOOK + "\n"

LONG_USER_TURNS = USER_TURNS + [
    "Going back to the beans at the North garden: the seedlings came up unevenly and a few were "
    "eaten overnight. Is that slugs, birds or mice, how can I tell, and should we resow the gaps "
    "now or wait another week?",
    "Jonas offered to build a cold frame from old windows for the River garden. Where should it "
    "stand given the spring floods, what should we start in it first, and what does he need to "
    "watch out for with old glass?",
    "A neighbour asked whether her kids can help on Saturdays. What small jobs in the gardens are "
    "safe and fun for children of six to ten, and which places should they stay away from?",
    "The compost in the North bays smells sour and is very wet. What went wrong, how do we fix "
    "it this month, and what should volunteers stop putting in there?",
    "For the Hill garden, the wind flattened the young peas twice already. What windbreak could "
    "we put up cheaply from what is in the shed, and which crops would cope better up there?",
    "Can you sum up which beds across the three gardens are still empty according to the records, "
    "and suggest one crop for each from the seed library surplus?",
    "Tomasz is new and wants to learn pruning. Could you write him a short, friendly plan for his "
    "first four Saturdays, pairing him with someone from the volunteer list who knows the job?",
    "Before the assembly, please list our spending so far, what is left, and the two purchases "
    "you would argue for first for the rest of the season, with one sentence of reason each.",
]


def messages_for_turn(turn: int, replies: list[str]) -> list[dict]:
    """The chat messages of turn ``turn`` (0-based) of the long conversation."""
    messages = [{"role": "system", "content": LONG_SYSTEM_PROMPT}]
    for i in range(turn):
        messages.append({"role": "user", "content": LONG_USER_TURNS[i]})
        messages.append({"role": "assistant", "content": replies[i]})
    messages.append({"role": "user", "content": LONG_USER_TURNS[turn]})
    return messages
