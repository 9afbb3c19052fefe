import sys, time, statistics, trio
sys.path.insert(0, "benchmarks")
import overhead as O
async def main(url):
    through = O.ThroughOrchestrator(url, 64)
    t, ttfts, tok = await O.run_slots(1, 200, through)
    print("client TTFT p50 ms", round(statistics.median(ttfts) * 1e3, 3))
trio.run(main, sys.argv[1])
