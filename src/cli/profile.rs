//! `moec profile SCHED`: runs a schedule as real inference over a prompt set and writes
//! how many tokens every gate routed to each (layer, expert), with co-activation counts:
//! the routing profile `--profile` feeds to `rank(..)` placement and to the cost model.
//!
//! Takes everything `moec run` takes (schedule, model, prompts, `--set`) plus `--out
//! FILE`; gives the profile as JSON (`ir::profile::RoutingProfile`) and a one-line summary.
//! The plan is lowered with every gate's routing read back, so the counts are the routing
//! the model really computed; a schedule without `gate` tasks (only `post_attn`) has no
//! routing on the host and is refused rather than written as an empty profile.

use super::run::{request, Failure, RunArgs};
use crate::ir::profile::RoutingProfile;
use crate::model::card::ModelCard;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

/// Arguments of `moec profile`.
#[derive(Debug, Clone, Args)]
pub struct ProfileArgs {
    /// The run: schedule, model, prompts and settings, as `moec run`.
    #[command(flatten)]
    pub run: RunArgs,
    /// Write the profile here (JSON).
    #[arg(long, short, value_name = "FILE")]
    pub out: PathBuf,
}

/// Runs `moec profile`.
pub fn run(args: &ProfileArgs) -> ExitCode {
    // The profile has the card's shape from the start (the model source is read here
    // and again by the run; a checkpoint is memory-mapped, so that costs little).
    let card: ModelCard = match crate::weights::source::load_model(&args.run.model.source()) {
        Ok(model) => model.checkpoint.card().clone(),
        Err(e) => return super::generate::fail(e.to_string()),
    };
    let profile = Arc::new(Mutex::new(RoutingProfile::empty(
        &card.name,
        card.layers,
        card.experts,
    )));
    let result = request(&args.run).and_then(|mut request| {
        request.collect_routing = Some(Arc::clone(&profile));
        crate::engine::run(&request, &mut |_, _| {})
    });
    let finished = match result {
        Ok(finished) => {
            for note in &finished.notes {
                eprintln!("moec: {note}");
            }
            finished
        }
        Err(Failure::Rendered(text)) => {
            eprint!("{text}");
            return ExitCode::from(1);
        }
        Err(Failure::Message(m)) => return super::generate::fail(m),
    };
    let profile = profile
        .lock()
        .map(|p| p.clone())
        .unwrap_or_else(|e| e.into_inner().clone());
    if profile.tokens == 0 {
        return super::generate::fail(format!(
            "{} read back no routing: profile with a schedule that runs `gate` tasks (e.g. schedules/fiddler.sched), not only `post_attn`",
            args.run.sched.display()
        ));
    }
    if let Err(e) = super::probe::write_atomically(&args.out, &profile.to_json()) {
        return super::generate::fail(format!("cannot write {}: {e}", args.out.display()));
    }
    let steps = finished.stats.steps.len();
    println!(
        "{}: {} tokens over {} steps, {} layers x {} experts -> {}",
        card.name,
        profile.tokens,
        steps,
        card.layers,
        card.experts,
        args.out.display()
    );
    ExitCode::SUCCESS
}
