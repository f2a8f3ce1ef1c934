package kvevents_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

func complete(t *testing.T, e *sim.Engine, prompt string) {
	t.Helper()
	resp, err := http.Post(e.URL()+"/v1/completions", "application/json",
		strings.NewReader(fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, prompt)))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

// The index follows a simulated engine's cache through its events, in both encodings: blocks
// stored, blocks evicted, and a restart (the sequence starts again at 0), after which the lost
// prefixes are no longer believed.
func TestSubscriberFollowsTheEngine(t *testing.T) {
	for _, enc := range []string{sim.KVEventsArray, sim.KVEventsMap} {
		t.Run(enc, func(t *testing.T) {
			cfg := sim.Config{Model: "m", PrefixCache: true, PrefixCacheBlocks: 64, KVEvents: true, KVEventsEncoding: enc}
			e, err := sim.Start(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { e.Close() }()
			idx := kvevents.NewIndex(1 << 20)
			s := &kvevents.Subscriber{Worker: "w", Model: "m", Endpoint: e.KVEventsEndpoint(), Index: idx, Log: slog.New(slog.DiscardHandler)}
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			go s.Run(ctx)
			// ZMQ drops what is published before the subscriber joins: warm up with throwaway prompts.
			for i := 0; ; i++ {
				complete(t, e, fmt.Sprintf("warm up %d %s", i, strings.Repeat("x ", 40)))
				time.Sleep(20 * time.Millisecond)
				if n, _ := idx.Size(); n > 0 {
					break
				}
				if i > 200 {
					t.Fatal("no KV event reached the subscriber")
				}
			}
			prompt := strings.Repeat("the relay hands the baton over ", 12)
			tokens := sim.Tokenize(prompt)
			keys := kvevents.Keys("m", "", tokens, 16)
			complete(t, e, prompt)
			poll.Until(t, "the prompt's blocks", func() bool { return idx.Match(keys)["w"] == len(keys) })
			// Other prompts fill the 64-block cache and evict it.
			for i := 0; i < 40; i++ {
				complete(t, e, fmt.Sprintf("filler %d %s", i, strings.Repeat("y ", 60)))
			}
			poll.Until(t, "the eviction", func() bool { return idx.Match(keys)["w"] == 0 })
			// A restart on the same endpoints: the new engine's first event clears the old view.
			complete(t, e, prompt)
			poll.Until(t, "the prompt again", func() bool { return idx.Match(keys)["w"] == len(keys) })
			port := strings.TrimPrefix(e.KVEventsEndpoint(), "tcp://127.0.0.1:")
			e.Close()
			cfg.KVEventsPort = atoi(t, port)
			if e, err = sim.Start(cfg); err != nil {
				t.Fatal(err)
			}
			for i := 0; s.Stats().Resets == 0; i++ {
				complete(t, e, fmt.Sprintf("after restart %d %s", i, strings.Repeat("z ", 40)))
				time.Sleep(20 * time.Millisecond)
				if i > 300 {
					t.Fatalf("the restart was never seen: %+v", s.Stats())
				}
			}
			if got := idx.Match(keys)["w"]; got != 0 {
				t.Fatalf("after the engine restarted the index still believes %d blocks of a prompt it lost", got)
			}
			if st := s.Stats(); st.Malformed != 0 || st.Received == 0 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

func atoi(t *testing.T, s string) int {
	var n int
	if _, err := fmt.Sscan(s, &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Batches lost on the way (the publisher drops every third) are fetched from the engine's replay
// endpoint, in order, and the index ends up with every prompt; without a replay endpoint, each
// gap forgets the worker instead.
func TestSubscriberReplaysGaps(t *testing.T) {
	for _, withReplay := range []bool{true, false} {
		t.Run(fmt.Sprint("replay=", withReplay), func(t *testing.T) {
			e, err := sim.Start(sim.Config{Model: "m", PrefixCache: true, KVEvents: true, KVEventsDropEvery: 3})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			idx := kvevents.NewIndex(1 << 20)
			s := &kvevents.Subscriber{Worker: "w", Model: "m", Endpoint: e.KVEventsEndpoint(), Index: idx, Log: slog.New(slog.DiscardHandler)}
			if withReplay {
				s.ReplayEndpoint = e.KVEventsReplayEndpoint()
			}
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			go s.Run(ctx)
			for i := 0; s.Stats().Received == 0; i++ {
				complete(t, e, fmt.Sprintf("warm up %d %s", i, strings.Repeat("x ", 40)))
				time.Sleep(20 * time.Millisecond)
				if i > 200 {
					t.Fatal("no KV event reached the subscriber")
				}
			}
			var all [][]uint64
			for i := 0; i < 9; i++ {
				prompt := fmt.Sprintf("prompt %d %s", i, strings.Repeat("the relay hands the baton over ", 6))
				complete(t, e, prompt)
				all = append(all, kvevents.Keys("m", "", sim.Tokenize(prompt), 16))
			}
			complete(t, e, "flush "+strings.Repeat("f ", 40)) // a last batch after the prompts
			complete(t, e, "flush again "+strings.Repeat("g ", 40))
			poll.Until(t, "the gaps", func() bool { return s.Stats().Gaps >= 2 })
			st := s.Stats()
			if withReplay {
				poll.Until(t, "every prompt", func() bool {
					for _, keys := range all {
						if idx.Match(keys)["w"] != len(keys) {
							return false
						}
					}
					return true
				})
				if st = s.Stats(); st.Replays != st.Gaps || st.Resets != 0 {
					t.Fatalf("stats %+v: want every gap replayed", st)
				}
				return
			}
			if st.Replays != 0 {
				t.Fatalf("replays without an endpoint: %+v", st)
			}
			missing := 0
			for _, keys := range all {
				if idx.Match(keys)["w"] != len(keys) {
					missing++
				}
			}
			if missing == 0 {
				t.Fatal("gaps without replay left every prompt in the index")
			}
		})
	}
}

// Item 13 (should): an engine that restarted and is first heard again at a sequence past the
// old one's looks like a gap; its replay comes from the new process, and applying it on top of
// the old view kept blocks the engine lost. The batch at the last sequence applied is checked:
// another process's means a restart, and the worker's blocks are forgotten.
func TestSubscriberSeesARestartPastTheOldSequence(t *testing.T) {
	ports := func(e *sim.Engine) (int, int) {
		return atoi(t, e.KVEventsEndpoint()[strings.LastIndexByte(e.KVEventsEndpoint(), ':')+1:]),
			atoi(t, e.KVEventsReplayEndpoint()[strings.LastIndexByte(e.KVEventsReplayEndpoint(), ':')+1:])
	}
	cfg := sim.Config{Model: "m", PrefixCache: true, KVEvents: true}
	e, err := sim.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	idx := kvevents.NewIndex(1 << 20)
	s := &kvevents.Subscriber{Worker: "w", Model: "m", Endpoint: e.KVEventsEndpoint(), ReplayEndpoint: e.KVEventsReplayEndpoint(),
		Index: idx, Log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	for i := 0; ; i++ {
		complete(t, e, fmt.Sprintf("warm up %d %s", i, strings.Repeat("x ", 40)))
		time.Sleep(20 * time.Millisecond)
		if n, _ := idx.Size(); n > 0 {
			break
		}
		if i > 200 {
			t.Fatal("no KV event reached the subscriber")
		}
	}
	prompt := strings.Repeat("blocks the old process held ", 12)
	keys := kvevents.Keys("m", "", sim.Tokenize(prompt), 16)
	complete(t, e, prompt)
	poll.Until(t, "the prompt's blocks", func() bool { return idx.Match(keys)["w"] == len(keys) })
	last := s.Stats().LastSeq
	// The subscriber is away while the engine restarts on the same endpoints and publishes
	// past the old sequence.
	cancel()
	<-done
	cfg.KVEventsPort, cfg.KVEventsReplayPort = ports(e)
	e.Close()
	if e, err = sim.Start(cfg); err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for i := int64(0); i <= last+3; i++ {
		complete(t, e, fmt.Sprintf("new process %d %s", i, strings.Repeat("n ", 40)))
	}
	ctx, cancel = context.WithCancel(t.Context())
	defer cancel()
	go s.Run(ctx)
	for i := 0; s.Stats().LastSeq <= last+3; i++ {
		complete(t, e, fmt.Sprintf("after %d %s", i, strings.Repeat("a ", 40)))
		time.Sleep(20 * time.Millisecond)
		if i > 300 {
			t.Fatalf("the new process was never heard: %+v", s.Stats())
		}
	}
	if got := idx.Match(keys)["w"]; got != 0 {
		t.Fatalf("after a restart heard past the old sequence, the index still believes %d blocks the engine lost (%+v)", got, s.Stats())
	}
	if st := s.Stats(); st.Resets == 0 {
		t.Errorf("no reset counted: %+v", st)
	}
}
