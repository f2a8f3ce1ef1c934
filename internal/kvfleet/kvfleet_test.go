package kvfleet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/worker"
)

// Listened-to topics name workers by host and port (or host alone when only one worker is
// there); anything else names nobody, and ranks are bounded.
func TestKVEventsTopicRouting(t *testing.T) {
	cfg := config.Default()
	cfg.KVEventsListen = "tcp://127.0.0.1:0"
	cfg.Workers = []config.Worker{{URL: "http://10.0.0.1:8000"}, {URL: "http://10.0.0.1:8001"}, {URL: "http://10.0.0.2:8000"}, {URL: "http://[fd00::5]:8000"}}
	var ws []*worker.Worker
	for _, c := range cfg.Workers {
		ws = append(ws, worker.New(c))
	}
	k := New(cfg, ws, worker.NewRegistry(ws...), slog.New(slog.DiscardHandler))
	for _, c := range []struct {
		topic string
		rank  int
		want  string
	}{
		{"kv@10.0.0.1:8001@m", 0, "http://10.0.0.1:8001"},
		{"kv@10.0.0.2@m", 2, "http://10.0.0.2:8000"},
		{"kv@[fd00::5]:8000@m", 0, "http://[fd00::5]:8000"},
		{"kv@10.0.0.1@m", 0, ""}, // two workers on that host
		{"kv@10.0.0.3:8000@m", 0, ""},
		{"", 0, ""},
		{"kv-events", 0, ""},
		{"kv@10.0.0.2:8000@m", worker.MaxTrackedRanks, ""},
		{"kv@10.0.0.2:8000@m", -1, ""},
	} {
		got := ""
		peer := netip.MustParseAddr("10.0.0.1")
		if u, err := url.Parse(c.want); err == nil && c.want != "" {
			peer = netip.MustParseAddr(u.Hostname())
		}
		if s, _ := k.route(c.topic, c.rank, peer); s != nil {
			got = s.Worker
			if s.Rank != c.rank {
				t.Errorf("%q rank %d: subscriber for rank %d", c.topic, c.rank, s.Rank)
			}
		}
		if got != c.want {
			t.Errorf("%q rank %d: routed to %q, want %q", c.topic, c.rank, got, c.want)
		}
	}
	if v, _ := k.View(ws[2]).(*KVEventsView); v == nil || v.Ranks != 1 || v.Source != "listen" {
		t.Errorf("view after rank 2 was heard from: %+v", v)
	}
}

// Medium 7: a topic names a worker, but only the worker's own address may publish for it —
// anyone else who reaches the listener could steer cache_aware to a chosen worker or clear
// another's blocks. A worker named by host name is checked against what the name resolves to.
func TestKVEventsTopicFromAnotherAddressIsRefused(t *testing.T) {
	cfg := config.Default()
	cfg.KVEventsListen = "tcp://127.0.0.1:0"
	cfg.Workers = []config.Worker{{URL: "http://10.0.0.1:8000"}, {URL: "http://engine-a.fleet:8000"}}
	var ws []*worker.Worker
	for _, c := range cfg.Workers {
		ws = append(ws, worker.New(c))
	}
	k := New(cfg, ws, worker.NewRegistry(ws...), slog.New(slog.DiscardHandler))
	lookups := 0
	k.peers.lookup = func(_ context.Context, host string) ([]netip.Addr, error) {
		lookups++
		if host == "engine-a.fleet" {
			return []netip.Addr{netip.MustParseAddr("10.0.0.7")}, nil
		}
		return nil, errors.New("no such host")
	}
	for _, c := range []struct {
		topic, peer string
		want        error
	}{
		{"kv@10.0.0.1:8000@m", "10.0.0.1", nil},
		{"kv@10.0.0.1:8000@m", "::ffff:10.0.0.1", nil},
		{"kv@10.0.0.1:8000@m", "10.0.0.9", kvevents.ErrForeignPeer},
		{"kv@10.0.0.1:8000@m", "127.0.0.1", kvevents.ErrForeignPeer},
		{"kv@engine-a.fleet:8000@m", "10.0.0.7", nil},
		{"kv@engine-a.fleet:8000@m", "10.0.0.1", kvevents.ErrForeignPeer},
		{"kv@10.0.0.5:8000@m", "10.0.0.5", kvevents.ErrUnknownTopic},
	} {
		s, err := k.route(c.topic, 0, netip.MustParseAddr(c.peer).Unmap())
		if !errors.Is(err, c.want) || (c.want == nil) != (s != nil) {
			t.Errorf("%q from %s: subscriber %v, error %v; want error %v", c.topic, c.peer, s != nil, err, c.want)
		}
	}
	if lookups != 1 {
		t.Errorf("the worker's host name was looked up %d times, want once (cached)", lookups)
	}
}

// Medium 7: the index bound follows the memory limit: today's fixed 4 M blocks (about 1 GiB
// at its peak) could not fit the Helm chart's 1 GiB pod. A quarter of GOMEMLIMIT, else of the
// cgroup's memory.max, else the fixed bound.
func TestKVIndexBoundFollowsTheMemoryLimit(t *testing.T) {
	old := debug.SetMemoryLimit(-1)
	defer debug.SetMemoryLimit(old)
	dir := t.TempDir()
	cg := func(v string) string {
		p := filepath.Join(dir, fmt.Sprint(len(v)))
		if err := os.WriteFile(p, []byte(v+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	debug.SetMemoryLimit(math.MaxInt64)
	if b, from, _ := kvIndexBound(filepath.Join(dir, "absent")); b != maxKVIndexBlocks || from != "" {
		t.Errorf("no limit known: %d blocks from %q, want %d", b, from, maxKVIndexBlocks)
	}
	if b, _, _ := kvIndexBound(cg("max")); b != maxKVIndexBlocks {
		t.Errorf("cgroup without a limit: %d blocks, want %d", b, maxKVIndexBlocks)
	}
	b, from, _ := kvIndexBound(cg("1073741824"))
	if from != "the cgroup memory limit" || b*kvIndexBytesPerBlock > 1<<30/4 || b < 1<<30/4/kvIndexBytesPerBlock-1 {
		t.Errorf("1 GiB cgroup: %d blocks from %q, want a quarter of it at %d B/block", b, from, kvIndexBytesPerBlock)
	}
	debug.SetMemoryLimit(920 << 20) // the chart's GOMEMLIMIT wins over the cgroup
	if b, from, _ := kvIndexBound(cg("1073741824")); from != "GOMEMLIMIT" || b != 920<<20/4/kvIndexBytesPerBlock {
		t.Errorf("GOMEMLIMIT 920 MiB: %d blocks from %q", b, from)
	}
	debug.SetMemoryLimit(64 << 40)
	if b, _, _ := kvIndexBound(""); b != maxKVIndexBlocks {
		t.Errorf("a huge limit: %d blocks, want the fixed bound %d", b, maxKVIndexBlocks)
	}
}

// A worker with DP ranks is subscribed on one endpoint per rank (port + r), as vLLM publishes;
// with --kv-events, a worker that names no endpoint is subscribed at its host's 5557 once it
// registers.
func TestKVEventsOneSubscriptionPerRank(t *testing.T) {
	cfg := config.Default()
	cfg.Workers = []config.Worker{{URL: "http://dp:8000", DPSize: 3, KVEventsEndpoint: "tcp://dp:5557", KVEventsReplayEndpoint: "tcp://dp:6557"}, {URL: "http://plain:8000"}}
	ws := []*worker.Worker{worker.New(cfg.Workers[0]), worker.New(cfg.Workers[1])}
	endpoints := func(k *KVEvents, url string) string {
		var eps []string
		if k.subs[url] != nil {
			for _, s := range k.subs[url].ranks {
				eps = append(eps, fmt.Sprintf("%s %s rank %d", s.Endpoint, s.ReplayEndpoint, s.Rank))
			}
		}
		return strings.Join(eps, ", ")
	}
	k := New(cfg, ws, worker.NewRegistry(ws...), slog.New(slog.DiscardHandler))
	k.Registered(ws[1])
	if got := endpoints(k, "http://dp:8000"); got != "tcp://dp:5557 tcp://dp:6557 rank 0, tcp://dp:5558 tcp://dp:6558 rank 1, tcp://dp:5559 tcp://dp:6559 rank 2" || k.subs["http://plain:8000"] != nil {
		t.Fatalf("subscriptions %q", got)
	}
	cfg.KVEvents = true // every worker, at its host's 5557
	k = New(cfg, ws, worker.NewRegistry(ws...), slog.New(slog.DiscardHandler))
	if k.subs["http://plain:8000"] != nil {
		t.Fatal("subscribed to a worker that names no endpoint before it registered")
	}
	k.Registered(ws[1])
	if got := endpoints(k, "http://plain:8000"); got != "tcp://plain:5557  rank 0" {
		t.Fatalf("kv_events on: %q", got)
	}
}
