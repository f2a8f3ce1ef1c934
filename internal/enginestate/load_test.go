package enginestate

import (
	"strings"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name, text           string
		running, waiting, kv float64
		hasRunning, hasKV    bool
	}{
		{"vllm, two models", `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3
vllm:num_requests_running{model_name="b"} 2
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 4
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.25
vllm:kv_cache_usage_perc{model_name="b"} 0.75
`, 5, 4, 0.75, true, true},
		{"vllm, older KV name", `vllm:num_requests_running 1
vllm:num_requests_waiting 0
vllm:gpu_cache_usage_perc 0.5
`, 1, 0, 0.5, true, true},
		{"sglang, DP ranks", `# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0"} 7
sglang:num_running_reqs{dp_rank="1"} 1
sglang:num_queue_reqs{dp_rank="0"} 2
sglang:token_usage{dp_rank="0"} 0.9
`, 8, 2, 0.9, true, true},
		{"neither", "other_metric 1\n", 0, 0, 0, false, false},
		// An engine's NaN, infinity or negative gauge is no load (it would break routing and
		// GET /workers' JSON).
		{"not numbers", `vllm:num_requests_running NaN
vllm:num_requests_waiting -3
vllm:kv_cache_usage_perc +Inf
`, 0, 0, 0, false, false},
		{"one series of two bad", `sglang:num_running_reqs{dp_rank="0"} NaN
sglang:num_running_reqs{dp_rank="1"} 4
`, 4, 0, 0, true, false},
	} {
		l, err := Parse(strings.NewReader(tc.text))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if l.Running != tc.running || l.Waiting != tc.waiting || l.KVUsage != tc.kv || l.HasRunning != tc.hasRunning || l.HasKV != tc.hasKV {
			t.Errorf("%s: %+v", tc.name, l)
		}
		if time.Since(l.At) > time.Minute {
			t.Errorf("%s: read at %v", tc.name, l.At)
		}
	}
	if _, err := Parse(strings.NewReader("{not prometheus")); err == nil {
		t.Error("garbage parsed")
	}
}

// vLLM's lora_requests_info keeps every label set it ever had, its value the time it was set:
// the latest is now. Label values are bounded.
func TestParseLoRARequestsInfo(t *testing.T) {
	l, err := Parse(strings.NewReader(`# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.75e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="older",waiting_lora_adapters=""} 1.6e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="summed",waiting_lora_adapters=""} 3.5e9
`))
	if err != nil {
		t.Fatal(err)
	}
	if !l.HasLoRA || l.MaxLoRA != 4 || strings.Join(l.LoRARunning, ",") != "a,b" || strings.Join(l.LoRAWaiting, ",") != "c" {
		t.Fatalf("%+v", l)
	}
	many := strings.Repeat("x,", 5000)
	l, _ = Parse(strings.NewReader(`vllm:lora_requests_info{max_lora="-1",running_lora_adapters="` + many + `",waiting_lora_adapters=""} 1` + "\n"))
	if len(l.LoRARunning) != maxAdapterNames || l.MaxLoRA != 0 {
		t.Fatalf("unbounded: %d names, max %d", len(l.LoRARunning), l.MaxLoRA)
	}
	if l, _ := Parse(strings.NewReader("vllm:num_requests_running 1\n")); l.HasLoRA {
		t.Fatal("no lora_requests_info, yet HasLoRA")
	}
}
