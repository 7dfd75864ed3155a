//! Setting the CUDA backend up: the device opened, kernels loaded, the `gpu` arena and the
//! pinned arena in place, one CUDA stream (and cuBLAS handle) per device stream, and each
//! stream's scratch arena reserved at the bound the compiler budgeted.

use super::*;

/// The plan's tasks on device streams.
fn device_tasks(plan: &ExecPlan) -> impl Iterator<Item = &PlanTask> {
    plan.tasks.iter().filter(|t| {
        plan.streams
            .get(t.stream.index())
            .is_some_and(|s| is_device(s.engine))
    })
}

/// Per plan stream, the scratch rules' bound over its device tasks (`super::scratch`),
/// the same as `moec check` counts (`cost::budget`).
fn scratch_bounds(plan: &ExecPlan) -> Vec<Option<StreamScratch>> {
    let mut rules = crate::runtime::cuda::scratch::ScratchRules::new(&plan.model, &plan.workload);
    let tasks = device_tasks(plan).map(|t| {
        let facts = crate::ir::scratch::TaskFacts::new(
            t.op,
            t.shape,
            t.kv.map(|k| k.part),
            t.args.iter().map(|a| a.role),
        );
        (t.stream.index(), t.id, facts)
    });
    crate::ir::scratch::stream_bounds(&mut rules, plan.streams.len(), tasks)
        .into_iter()
        .enumerate()
        .map(|(s, bound)| {
            let (bytes, task) = bound?;
            Some(StreamScratch {
                stream: plan.streams[s].name.clone(),
                bound: bytes,
                task: plan
                    .tasks
                    .iter()
                    .find(|t| t.id == task)
                    .map_or_else(String::new, |t| t.name.clone()),
            })
        })
        .collect()
}

/// The plan's format copies of the experts as (offset, bytes) in the `host` arena,
/// where lowering placed them.
fn format_copy_ranges(plan: &ExecPlan) -> Vec<(u64, u64)> {
    plan.format_copies
        .iter()
        .filter_map(|copy| plan.buffers.get(copy.buffer.index()))
        .filter_map(|slot| match slot.placement {
            crate::lower::Placement::Arena {
                space: crate::ir::Space::Host,
                offset,
            } => Some((offset, slot.bytes)),
            _ => None,
        })
        .collect()
}

impl<'c> CudaBackend<'c> {
    /// Opens the device, loads the kernels, allocates the `gpu` arena and creates one CUDA
    /// stream (and cuBLAS handle) per device stream of the plan. `host_memory` is the
    /// plan's host side (`HostMemory::host_side`: no `gpu` arena) and `host` the engine
    /// that runs the plan's `cpu.*` streams over it.
    pub fn new(
        plan: &ExecPlan,
        host_memory: Arc<HostMemory<'c>>,
        host: Box<dyn Backend + 'c>,
        options: &BackendOptions,
    ) -> Result<Self, CudaSetupError> {
        // The device kernels multiply bf16 weights with f32 activations; with the CPU's bf16
        // product selected the host-side tasks would compute another arithmetic than the
        // device's, and the run would leave the oracle's tokens: refused before any launch.
        if crate::math::isa::Kernels::process().bf16_dot() {
            return Err(CudaSetupError::Unsupported(
                "the bf16 product (MOEC_BF16_PRODUCT=bf16: its kernels keep f32 activations \
                 for bf16 weights; unset it for --backend cuda)"
                    .into(),
            ));
        }
        let device = Device::open()?;
        let call = |doing: &'static str| {
            move |e: DriverError| CudaSetupError::Call {
                doing,
                detail: e.to_string(),
            }
        };
        let arch = ArchSpec::from_card(&plan.model);
        if let Some(what) =
            crate::runtime::cuda::ops::unsupported(&arch, &host_memory.layout().layer)
        {
            return Err(CudaSetupError::Unsupported(what));
        }
        let mut streams = Vec::with_capacity(plan.streams.len());
        for s in &plan.streams {
            if is_device(s.engine) {
                let stream = device.ctx.new_stream().map_err(call("creating a stream"))?;
                let blas =
                    CudaBlas::new(Arc::clone(&stream)).map_err(|e| CudaSetupError::Call {
                        doing: "creating a cuBLAS handle",
                        detail: format!("{e:?}"),
                    })?;
                streams.push(Some(DevStream {
                    stream,
                    blas: Arc::new(blas),
                    workspace: Workspace::default(),
                }));
            } else {
                streams.push(None);
            }
        }
        let setup_stream = match streams.iter().flatten().next() {
            Some(s) => Arc::clone(&s.stream),
            None => device.ctx.new_stream().map_err(call("creating a stream"))?,
        };
        let gpu_bytes = plan.arena(crate::ir::Space::Gpu).bytes;
        let memory = DeviceMemory::new(
            &device,
            &setup_stream,
            gpu_bytes,
            options.gpu_capacity,
            &host_memory,
            options.weight_copies,
            &format_copy_ranges(plan),
        )?;
        // Each device stream's scratch reserved at its budgeted bound: a run within the
        // budget never grows it (the report says when a task took more).
        let scratch = scratch_bounds(plan);
        for (dev, bound) in streams.iter().zip(&scratch) {
            if let (Some(dev), Some(b)) = (dev, bound) {
                dev.workspace
                    .reserve(&dev.stream, b.bound as usize)
                    .map_err(|e| CudaSetupError::Call {
                        doing: "reserving a stream's scratch",
                        detail: e.to_string(),
                    })?;
            }
        }
        let task_names = device_tasks(plan).map(|t| (t.id, t.name.clone())).collect();
        let expert_sources =
            ExpertSources::new(&setup_stream, streams.len(), !plan.format_copies.is_empty())
                .map_err(call("allocating the expert counters"))?;
        // The CPU's own tables (YaRN-scaled for gpt-oss), so rotary agrees bit for bit.
        let table = RopeTable::for_arch(&arch, arch.max_positions);
        let (cos, sin) = table.tables();
        let rope = (
            setup_stream
                .clone_htod(cos)
                .map_err(call("uploading the rotary tables"))?,
            setup_stream
                .clone_htod(sin)
                .map_err(call("uploading the rotary tables"))?,
        );
        let rope_ptrs = (
            rope.0.device_ptr(&setup_stream).0,
            rope.1.device_ptr(&setup_stream).0,
        );
        setup_stream
            .synchronize()
            .map_err(call("finishing set-up"))?;
        let n_events = plan.event_count();
        let events = (0..n_events)
            .map(|_| {
                Ok(PlanEvent {
                    event: Arc::new(
                        device
                            .ctx
                            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                            .map_err(call("creating an event"))?,
                    ),
                    recorded_on: AtomicU8::new(0),
                })
            })
            .collect::<Result<Vec<_>, CudaSetupError>>()?;
        // A host stream gets a host lane: the CUDA stream its tasks go to as host nodes
        // when it waits for device work inside a recorded step (`graph::HostRole`).
        let lanes = streams
            .iter()
            .map(|s| match s {
                Some(d) => Ok(Some(Lane {
                    stream: Arc::clone(&d.stream),
                    blas: Some(Arc::clone(&d.blas)),
                })),
                None => Ok(Some(Lane {
                    stream: device
                        .ctx
                        .new_stream()
                        .map_err(call("creating a host lane"))?,
                    blas: None,
                })),
            })
            .collect::<Result<Vec<_>, CudaSetupError>>()?;
        let fork_join = (0..=lanes.len())
            .map(|_| {
                device
                    .ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(call("creating an event"))
            })
            .collect::<Result<Vec<_>, CudaSetupError>>()?;
        // cuBLAS's start-up and its kernels' first loads, at load rather than in the
        // first prefill (`warmup`).
        let handles = streams
            .iter()
            .map(|d| d.as_ref().map(|d| (&d.stream, &d.blas)));
        let warm_up = crate::runtime::cuda::warmup::for_plan(plan, &arch, handles);
        let recorder = Recorder::new(
            lanes,
            events.iter().map(|e| Arc::clone(&e.event)).collect(),
            fork_join,
        );
        Ok(CudaBackend {
            memory,
            recorder,
            step: AtomicUsize::new(0),
            recording_step: AtomicBool::new(false),
            device_guards: AtomicBool::new(false),
            host_roles: Mutex::default(),
            run_capacity: Mutex::default(),
            graphs: Mutex::default(),
            plan_reasons: Mutex::default(),
            events,
            timing: Mutex::default(),
            streams,
            _rope: rope,
            rope_ptrs,
            expert_sources,
            host,
            host_memory,
            dtype: plan.model.dtype,
            arch,
            routing_syncs: AtomicUsize::new(0),
            guard_readbacks: AtomicUsize::new(0),
            sampled_ids: SampledIds::default(),
            launched: Mutex::default(),
            next_ticket: AtomicUsize::new(0),
            ops_run: AtomicUsize::new(0),
            replays_without_ops: AtomicUsize::new(0),
            launched_ahead: AtomicUsize::new(0),
            verified: AtomicUsize::new(0),
            ran_ops_because: Mutex::default(),
            warm_up,
            scratch,
            task_names,
            device,
        })
    }
}
