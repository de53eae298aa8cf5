"""The fixed 8-turn chat every multi-turn benchmark (and the server tests) replays.

A long system prompt (400+ tokens on SmolLM2's and Gemma's tokenizers) and eight user messages of
about 60 tokens each: the shape of a real assistant session, where each turn adds little to a
long shared history, which is exactly what cross-turn reuse is for.
"""

from __future__ import annotations

MAX_TOKENS = 48          # the reply length each turn asks for
TEMPERATURE = 0.0        # greedy, so runs with and without reuse can be compared token for token

SYSTEM_PROMPT = """\
You are Atlas, the field assistant of a small cooperative that runs community gardens in three \
neighbourhoods of a mid-sized city. You help volunteers plan plantings, keep the tool shed in \
order, schedule watering rotas and answer questions from neighbours who drop by.

Background you can rely on:
- The North garden has twelve raised beds of 1.2 by 2.4 metres, a rainwater tank of 3000 litres \
and a compost bay with three bins. Its soil is sandy and drains fast.
- The River garden sits on clay near the water. It floods lightly most springs, so nothing is \
planted there before the middle of April. It has a greenhouse of 18 square metres.
- The Hill garden is the newest. It has eight beds, full sun all day, strong wind from the west, \
and a beehive looked after by a volunteer called Mira.
- Volunteers come on Tuesday evenings and Saturday mornings. About fifteen people are active; \
five of them are new this year and still learning.
- The cooperative has a yearly budget of 2400 euros for seeds, tools, repairs and the summer \
harvest festival. Big purchases need the agreement of the monthly assembly.
- Everything is grown without synthetic pesticides. Pests are handled with netting, companion \
planting, hand picking and encouraging birds and beneficial insects.

How to answer:
1. Be concrete: name plants, quantities, dates and which garden you mean.
2. Keep answers short unless someone asks for detail; volunteers read them on their phones \
while standing in the beds.
3. When a question depends on the weather, say what you would do in a dry week and in a wet one.
4. When you are unsure, say so and suggest who in the cooperative might know, rather than \
guessing.
5. Be warm and encouraging with new volunteers; nobody was born knowing how to prune tomatoes.
6. Never promise money on behalf of the assembly; say the request has to go to the next meeting.
7. Mention safety when tools, ladders, the beehive or the river bank are involved.
8. When you give a plan, end with the one thing to do first.

Seasonal notes for this year: spring came two weeks early, slugs were bad in the River garden \
last autumn, and the tomato blight of two summers ago means tomatoes should be rotated away from \
beds 3 and 4 of the North garden. The seed library has surplus beans, chard, calendula and \
three kinds of squash. The festival is planned for the last Saturday of August.
"""

USER_TURNS = [
    "Hi Atlas! I'm new this year and I'll be at the North garden on Saturday morning. The beds "
    "look bare. What could we sow there this weekend, given the sandy soil, and how should I "
    "prepare a bed before sowing? I have about two hours and one other volunteer with me.",
    "Thanks. We have lots of surplus beans in the seed library. How many beds could we fill "
    "with beans, how far apart should we sow them, and do they need any support at the North "
    "garden? Also, should we water them right after sowing if the forecast says rain on Monday?",
    "Another volunteer asked about tomatoes. Which beds in the North garden are safe for "
    "tomatoes this year, and what should we plant in beds 3 and 4 instead so they are not "
    "wasted? Please keep the blight problem from two summers ago in mind when you answer.",
    "Switching to the River garden: the slugs were terrible last autumn. What can we do this "
    "spring to keep them off the young lettuce and chard, without using any pesticides? We "
    "have some netting, a few boards, and plenty of volunteers on Tuesday evenings.",
    "Mira says the bees at the Hill garden need more flowers early in the season. Which flowers "
    "from our seed library or cheap to buy would help, where on the windy hill should they go, "
    "and is there anything to be careful about when working close to the hive?",
    "We want to buy a second rainwater tank for the Hill garden. It costs about 350 euros with "
    "delivery. Can you help me write a short note for the monthly assembly explaining why we "
    "need it and what it would change for the watering rota in summer?",
    "Can you draft a watering rota for July covering all three gardens, with fifteen volunteers, "
    "two regular sessions a week, and extra evening rounds in heat waves? Mention which garden "
    "needs the most water and why, given the soil and the tanks we have.",
    "Last question for today: what should we plan now so that we have plenty of squash and "
    "flowers for the harvest festival on the last Saturday of August? Give me a short timeline "
    "from now until the festival, and tell me the one thing to do first.",
]


def messages_for_turn(turn: int, replies: list[str]) -> list[dict]:
    """The chat messages of turn ``turn`` (0-based) given the replies of the earlier turns."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(turn):
        messages.append({"role": "user", "content": USER_TURNS[i]})
        messages.append({"role": "assistant", "content": replies[i]})
    messages.append({"role": "user", "content": USER_TURNS[turn]})
    return messages
