package app

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

// Two Baton replicas share two engines and a storm of loads and unloads: more adapters than the
// engines hold at once (SGLang's --max-loaded-loras), every replica unloading the adapters it
// believes idle and refilling the engines as fast as the other empties them (on SGLang half the
// requests name their adapter in /generate's lora_path), and on vLLM an outside hand unloading
// adapters at random besides. Each replica
// learns of the other's work only from the engines' answers. Every request of a declared
// adapter is answered 200 by its adapter: not one 503 adapter_load_failed, not one engine 404
// or 400 for an adapter the other replica unloaded, nor — half the requests stream — SGLang's
// refusal inside a stream.
func TestTwoReplicasShareEnginesUnderAStorm(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		engine, unload string
		max            int
	}{
		{sim.EngineSGLang, "/unload_lora_adapter", 2},
		{sim.EngineVLLM, "/v1/unload_lora_adapter", 2},
	} {
		t.Run(c.engine, func(t *testing.T) {
			t.Parallel()
			const adapters, requests, clients = 7, 360, 24
			var engines []*sim.Engine
			var urls []string
			for i := 0; i < 2; i++ {
				e := loraEngine(t, sim.Config{Engine: c.engine, Model: "base", MaxLoRAs: c.max, LoRALoadTime: 5 * time.Millisecond,
					DecodePerToken: time.Millisecond, MaxConcurrency: 8})
				engines = append(engines, e)
				urls = append(urls, e.URL())
			}
			var gws []string
			for r := 0; r < 2; r++ {
				cfg := testConfig(urls...)
				cfg.UnloadLRU = true
				cfg.AdapterAffinity = true
				for a := 0; a < adapters; a++ {
					cfg.Adapters = append(cfg.Adapters, config.Adapter{Name: fmt.Sprintf("a%d", a), Path: fmt.Sprintf("/adapters/a%d", a), Base: "base"})
				}
				_, gw := startGateway(t, cfg)
				gws = append(gws, gw.URL)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var outside sync.WaitGroup
			if c.engine == sim.EngineVLLM { // vLLM never refuses a load: an outside hand unloads
				outside.Go(func() {
					rng := rand.New(rand.NewPCG(7, 7))
					for ctx.Err() == nil {
						e := engines[rng.IntN(len(engines))]
						body := fmt.Sprintf(`{"lora_name":"a%d"}`, rng.IntN(adapters))
						if resp, err := http.Post(e.URL()+c.unload, "application/json", strings.NewReader(body)); err == nil {
							resp.Body.Close()
						}
						time.Sleep(3 * time.Millisecond)
					}
				})
			}
			type failure struct {
				status int
				body   string
			}
			var mu sync.Mutex
			var failures []failure
			var ran int
			jobs := make(chan int)
			var wg sync.WaitGroup
			for k := 0; k < clients; k++ {
				wg.Go(func() {
					client := &http.Client{Timeout: 20 * time.Second}
					for i := range jobs {
						rng := rand.New(rand.NewPCG(uint64(i), 28))
						path, body := "/v1/completions", fmt.Sprintf(`{"model":"a%d","prompt":"storm %d","max_tokens":3}`, rng.IntN(adapters), i)
						if c.engine == sim.EngineSGLang && i%2 == 1 { // SGLang's own way: lora_path on /generate
							path, body = "/generate", fmt.Sprintf(`{"text":"storm %d","lora_path":"a%d","sampling_params":{"max_new_tokens":3}}`, i, rng.IntN(adapters))
						}
						if i%4 >= 2 { // half streamed: SGLang refuses a stream for an adapter it lacks inside it
							body = `{"stream":true,` + body[1:]
						}
						resp, err := client.Post(gws[(i/2)%2]+path, "application/json", strings.NewReader(body))
						if err != nil {
							mu.Lock()
							failures = append(failures, failure{0, err.Error()})
							mu.Unlock()
							continue
						}
						b, _ := io.ReadAll(resp.Body)
						resp.Body.Close()
						mu.Lock()
						if resp.StatusCode != 200 || strings.Contains(string(b), `{"error"`) {
							failures = append(failures, failure{resp.StatusCode, string(b)})
						} else {
							ran++
						}
						mu.Unlock()
					}
				})
			}
			for i := 0; i < requests; i++ {
				jobs <- i
			}
			close(jobs)
			wg.Wait()
			cancel()
			outside.Wait()
			var loads, unloads, served int64
			for _, e := range engines {
				l, u := e.LoRAStats()
				loads, unloads = loads+l, unloads+u
				for a := 0; a < adapters; a++ {
					served += e.AdapterRequests(fmt.Sprintf("a%d", a))
				}
			}
			t.Logf("%d requests: %d answered 200, %d failed; the engines loaded %d and unloaded %d adapters", requests, ran, len(failures), loads, unloads)
			if unloads == 0 {
				t.Error("no adapter was unloaded: the test stormed nothing")
			}
			for i, f := range failures {
				if i < 5 {
					t.Errorf("answered %d: %s", f.status, f.body)
				}
			}
			if served < int64(ran) {
				t.Errorf("the adapters ran %d requests, fewer than the %d answered 200 (a base answered some)", served, ran)
			}
		})
	}
}
