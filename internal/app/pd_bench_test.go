package app

import (
	"fmt"
	"net/http"
	"sync"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

// BenchmarkPDParallel measures PD dispatch through Baton against the same two legs sent by the
// client itself (bootstrap fields included) in the same run, on SGLang simulators.
func BenchmarkPDParallel(b *testing.B) {
	t := &testing.T{}
	p, err := sim.Start(sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill, Model: pdModel})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	d, err := sim.Start(sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode, Model: pdModel})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	cfg := config.Default()
	cfg.PDDisaggregation = true
	port := p.BootstrapPort()
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, BootstrapPort: &port}, {URL: d.URL(), Role: config.RoleDecode}}
	_, gw := startGateway(t, cfg)
	defer gw.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	send := func(url string, body []byte) { benchSend(b, client, url, body, "") }
	for _, stream := range []bool{false, true} {
		body := fmt.Sprintf(`{"text":"a benchmark prompt of a few words","sampling_params":{"max_new_tokens":8,"ignore_eos":true},"stream":%v}`, stream)
		b.Run(fmt.Sprintf("direct/stream=%v", stream), func(b *testing.B) {
			b.ReportAllocs()
			room := 0
			for b.Loop() {
				room++
				leg := []byte(fmt.Sprintf(`%s,"bootstrap_host":"127.0.0.1","bootstrap_port":%d,"bootstrap_room":%d}`, body[:len(body)-1], port, room))
				var wg sync.WaitGroup
				wg.Go(func() { send(p.URL()+"/generate", leg) })
				send(d.URL()+"/generate", leg)
				wg.Wait()
			}
		})
		b.Run(fmt.Sprintf("baton/stream=%v", stream), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				send(gw.URL+"/generate", []byte(body))
			}
		})
	}
}
